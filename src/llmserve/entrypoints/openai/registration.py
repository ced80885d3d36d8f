"""``llmserve serve --register-with ROUTER_URL``: a worker joins a router by itself.

Once the model is loaded (``/health`` is 200) the worker ``POST``s its URL to the
router's ``/workers`` (retrying while the router is not up, up to ``timeout_s``);
on SIGTERM it ``DELETE``s itself first, so the router drains it (no new requests)
while it finishes what it has. A router that already lists the URL (409) is fine:
the worker looks its id up. The membership API is the router's
(:mod:`llmserve.router.app`); an autoscaler adds workers the same way.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("llmserve.server")


class RouterRegistration:
    """Register ``worker_url`` with each router; ``deregister`` undoes it."""

    def __init__(self, routers: list[str], worker_url: str, timeout_s: float = 60.0) -> None:
        self.routers = [r.rstrip("/") for r in routers]
        self.worker_url = worker_url
        self.timeout_s = timeout_s
        self.ids: dict[str, str] = {}

    def register(self) -> None:
        import httpx

        for router in self.routers:
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    r = httpx.post(router + "/workers", json={"url": self.worker_url},
                                   timeout=10.0)
                    if r.status_code == 201:
                        self.ids[router] = r.json()["id"]
                    elif r.status_code == 409:  # listed already (e.g. by --worker)
                        ws = httpx.get(router + "/workers", timeout=10.0).json()["workers"]
                        self.ids[router] = next(w["id"] for w in ws
                                                if w["url"] == self.worker_url)
                    else:
                        logger.error("router %s refused registration: %s %s", router,
                                     r.status_code, r.text[:200])
                        break
                    logger.info("registered with router %s as %s", router, self.ids[router])
                    break
                except (httpx.HTTPError, ValueError, KeyError, StopIteration) as e:
                    if time.monotonic() > deadline:
                        logger.error("could not register with router %s: %s", router, e)
                        break
                    time.sleep(0.5)

    def deregister(self) -> None:
        import httpx

        for router, wid in list(self.ids.items()):
            try:
                httpx.delete(f"{router}/workers/{wid}", timeout=5.0)
                logger.info("left router %s (draining)", router)
            except httpx.HTTPError as e:
                logger.warning("could not leave router %s: %s", router, e)
            self.ids.pop(router, None)
