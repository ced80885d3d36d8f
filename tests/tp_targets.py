"""Worker targets for the launcher tests (a small module: spawned ranks import it)."""

import time


def raise_on_rank_1(rank, store, payload):
    if rank == 1:
        raise ValueError(f"cannot load shard {payload}")
    store.set(f"ready/{rank}", "1")
    time.sleep(600)


def never_ready(rank, store, payload):
    time.sleep(600)
