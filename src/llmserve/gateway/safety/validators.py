"""Checksum and format validators for PII candidates (pure functions, ``str -> bool``).

Sources: Luhn (ISO/IEC 7812-1 annex B); IBAN mod-97 (ISO 13616 / ISO 7064 MOD 97-10);
Chinese resident identity number (GB 11643-1999, ISO 7064 MOD 11-2 check digit);
US SSN rules (SSA: area not 000/666/900-999, group not 00, serial not 0000);
IP addresses via :mod:`ipaddress`; phone digit counts per ITU-T E.164 (<= 15 digits).
"""

from __future__ import annotations

import datetime as _dt
import ipaddress

# IBAN length per country (ISO 13616 registry, SWIFT release 2024)
IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22,
    "BH": 22, "BR": 29, "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22,
    "DK": 18, "DO": 28, "EE": 20, "EG": 29, "ES": 24, "FI": 18, "FO": 18, "FR": 27,
    "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28,
    "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20,
    "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "MC": 27, "MD": 24,
    "ME": 22, "MK": 19, "MR": 27, "MT": 31, "MU": 30, "NL": 18, "NO": 15, "PK": 24,
    "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "SA": 24, "SC": 31,
    "SE": 24, "SI": 19, "SK": 24, "SM": 27, "ST": 25, "SV": 28, "TL": 23, "TN": 24,
    "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
}

_CN_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_CN_CHECK = "10X98765432"


def _digits(s: str) -> str:
    return "".join(c for c in s if c.isdigit())


def luhn(s: str) -> bool:
    """Payment card number: 13-19 digits (separators ignored) passing the Luhn check."""
    d = _digits(s)
    if not 13 <= len(d) <= 19 or len(set(d)) == 1:
        return False
    total = 0
    for i, c in enumerate(reversed(d)):
        n = int(c)
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def iban(s: str) -> bool:
    """IBAN: known country, its registered length, and ``int(rearranged) % 97 == 1``."""
    t = "".join(s.split()).upper()
    if len(t) < 15 or not t.isalnum() or IBAN_LENGTHS.get(t[:2]) != len(t):
        return False
    rearranged = t[4:] + t[:4]
    return int("".join(str(int(c, 36)) for c in rearranged)) % 97 == 1


def cn_resident_id(s: str) -> bool:
    """Chinese 18-character resident ID: area code, real birth date, GB 11643 check digit."""
    t = s.upper()
    if len(t) != 18 or not t[:17].isdigit() or not (t[17].isdigit() or t[17] == "X"):
        return False
    if t[0] not in "123456789":
        return False
    try:
        born = _dt.date(int(t[6:10]), int(t[10:12]), int(t[12:14]))
    except ValueError:
        return False
    if not _dt.date(1900, 1, 1) <= born <= _dt.date.today():
        return False
    return _CN_CHECK[sum(int(c) * w for c, w in zip(t[:17], _CN_WEIGHTS)) % 11] == t[17]


def cn_id_check_digit(first17: str) -> str:
    """The GB 11643 check character for the first 17 digits (for building test data)."""
    return _CN_CHECK[sum(int(c) * w for c, w in zip(first17, _CN_WEIGHTS)) % 11]


def us_ssn(s: str) -> bool:
    """US SSN ``AAA-GG-SSSS``: area not 000/666/9xx, group not 00, serial not 0000."""
    d = _digits(s)
    if len(d) != 9:
        return False
    area, group, serial = d[:3], d[3:5], d[5:]
    return (area not in ("000", "666") and area[0] != "9" and group != "00"
            and serial != "0000" and d not in ("123456789", "078051120"))


def ipv4(s: str) -> bool:
    try:
        ipaddress.IPv4Address(s)
    except ValueError:
        return False
    return True


def ipv6(s: str) -> bool:
    if s.count(":") < 2 or not any(c.isalnum() for c in s):
        return False
    try:
        ipaddress.IPv6Address(s)
    except ValueError:
        return False
    return True


def phone(s: str) -> bool:
    """8-15 digits (E.164), not all one digit."""
    d = _digits(s)
    return 8 <= len(d) <= 15 and len(set(d)) > 1


def nanp_phone(s: str) -> bool:
    """North American number: area code and exchange start with 2-9."""
    d = _digits(s)
    if len(d) == 11 and d[0] == "1":
        d = d[1:]
    return len(d) == 10 and d[0] in "23456789" and d[3] in "23456789"


def always(s: str) -> bool:
    return True


VALIDATORS = {"luhn": luhn, "iban": iban, "cn_resident_id": cn_resident_id, "us_ssn": us_ssn,
              "ipv4": ipv4, "ipv6": ipv6, "phone": phone, "nanp_phone": nanp_phone,
              "none": always}
