"""Data-class detection: does a request's text contain PII or secrets, and of which kind?

The policy engine maps detector kinds to data classes and lets the strictest class found decide
which workers may see the request; this module only says which kinds are present and where.
A false negative sends personal data or a credential to a worker the operator ruled out, so the
detectors lean towards catching; a false positive only narrows the pool, but on ordinary text
(dates, prices, versions, order numbers) it would narrow it for no reason, so every pattern is
anchored on separators, prefixes or check digits rather than on bare runs of digits.

Patterns are compiled once at import. Each is guarded by lookarounds so that a number inside a
longer digit run, or glued to letters, is never matched in part. Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # detector kind, e.g. "email"
    start: int  # char offsets in the scanned text (the one text of `scan`'s inputs it was found in)
    end: int


class Detector(Protocol):
    """Anything with a kind and a find(). A detector may also offer find_first(text) ->
    Finding | None, which `scan` then uses to stop at the first hit (RegexDetector does)."""

    kind: str

    def find(self, text: str) -> list[Finding]: ...


class RegexDetector:
    """A compiled pattern plus an optional validator on the matched string.

    The validator carries what a regex cannot (check digits, issuer tables), so the pattern can
    stay a cheap candidate filter. Operators add their own kinds the same way, e.g.
    `RegexDetector("employee_id", r"EMP-\\d{6}")`.
    """

    __slots__ = ("kind", "pattern", "validator")

    def __init__(
        self,
        kind: str,
        pattern: str | re.Pattern[str],
        validator: Callable[[str], bool] | None = None,
    ) -> None:
        self.kind = kind
        self.pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
        self.validator = validator

    def find(self, text: str) -> list[Finding]:
        return [f for f in map(self._accept, self.pattern.finditer(text)) if f is not None]

    def find_first(self, text: str) -> Finding | None:
        """The first accepted finding only: `scan` needs presence, not a full list."""
        for match in self.pattern.finditer(text):
            finding = self._accept(match)
            if finding is not None:
                return finding
        return None

    def _accept(self, match: re.Match[str]) -> Finding | None:
        if self.validator is None or self.validator(match.group()):
            return Finding(self.kind, match.start(), match.end())
        return None

    def __repr__(self) -> str:
        return f"RegexDetector({self.kind!r}, {self.pattern.pattern!r})"


# --- check digits -------------------------------------------------------------------------------


def luhn_valid(digits: str) -> bool:
    """Luhn mod-10 check of a string of ASCII digits (anything else, or fewer than 2, is False)."""
    if len(digits) < 2 or not (digits.isascii() and digits.isdigit()):
        return False
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


# Registered IBAN lengths (ISO 13616 registry) for the countries we expect to see most. A country
# not listed is checked against the generic 15..34 range and mod-97 only.
_IBAN_LENGTHS: dict[str, int] = {
    "AD": 24, "AE": 23, "AT": 20, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BR": 29, "CH": 21,
    "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "EE": 20, "ES": 24, "FI": 18, "FO": 18, "FR": 27,
    "GB": 22, "GI": 23, "GL": 18, "GR": 27, "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IS": 26,
    "IT": 27, "KW": 30, "KZ": 20, "LB": 28, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "MC": 27,
    "MT": 31, "MU": 30, "NL": 18, "NO": 15, "PL": 28, "PT": 25, "QA": 29, "RO": 24, "RS": 22,
    "SA": 24, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "TN": 24, "TR": 26, "UA": 29,
}  # fmt: skip

_IBAN_SHAPE = re.compile(r"[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}")


def iban_valid(candidate: str) -> bool:
    """ISO 13616 check: shape, the country's registered length when known, then mod 97 == 1.

    Spaces are ignored (IBANs are printed in groups of four); letters may be either case.
    """
    iban = candidate.replace(" ", "").upper()
    if not _IBAN_SHAPE.fullmatch(iban):
        return False
    expected = _IBAN_LENGTHS.get(iban[:2])
    if expected is not None and len(iban) != expected:
        return False
    rearranged = iban[4:] + iban[:4]
    # int(c, 36) maps 0-9 to themselves and A..Z to 10..35, exactly the ISO 7064 substitution.
    return int("".join(str(int(c, 36)) for c in rearranged)) % 97 == 1


# (lowest prefix, highest prefix, allowed lengths) per issuer. Requiring an issuer prefix on top of
# Luhn turns "one random 16-digit id in ten passes" into a much rarer accident.
_CARD_ISSUERS: tuple[tuple[str, str, frozenset[int]], ...] = (
    ("4", "4", frozenset({13, 16, 19})),  # Visa
    ("51", "55", frozenset({16})),  # Mastercard
    ("2221", "2720", frozenset({16})),  # Mastercard 2-series
    ("34", "34", frozenset({15})),  # American Express
    ("37", "37", frozenset({15})),  # American Express
    ("6011", "6011", frozenset(range(16, 20))),  # Discover
    ("65", "65", frozenset(range(16, 20))),  # Discover
    ("35", "35", frozenset(range(16, 20))),  # JCB
)


def _card_valid(candidate: str) -> bool:
    digits = candidate.replace(" ", "").replace("-", "")
    known_issuer = any(
        lo <= digits[: len(lo)] <= hi and len(digits) in lengths for lo, hi, lengths in _CARD_ISSUERS
    )
    return known_issuer and luhn_valid(digits)


# US SSN: area not 000, 666 or 9xx (never issued), group not 00, serial not 0000.
def _ssn_valid(candidate: str) -> bool:
    area, group, serial = candidate.split("-")
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


# UK NINO prefixes: HMRC never uses D F I Q U V as first letter, D F I O Q U V as second, nor the
# pairs below. "QQ" is HMRC's published specimen (QQ 12 34 56 C), not a real allocation; it is
# accepted on purpose so that prompts quoting the specimen, and tests, behave like real numbers.
_NINO_UNALLOCATED = frozenset({"BG", "GB", "KN", "NK", "NT", "TN", "ZZ"})


def _nino_valid(candidate: str) -> bool:
    first, second = candidate[0], candidate[1]
    if first + second == "QQ":
        return True
    return first not in "DFIQUV" and second not in "DFIOQUV" and first + second not in _NINO_UNALLOCATED


def _nir_valid(candidate: str) -> bool:
    """French NIR: plausible month, then key == 97 - (first 13 digits mod 97).

    Corsican departments 2A/2B count as 19/18 for the key (INSEE rule). Months 20, 30-42 and
    50-99 are issued to people whose birth month is unknown, so they are valid too.
    """
    nir = candidate.replace(" ", "")
    month = int(nir[3:5])
    if not (1 <= month <= 12 or month == 20 or 30 <= month <= 42 or month >= 50):
        return False
    body = nir[:13].replace("2A", "19", 1).replace("2B", "18", 1)  # only the department can hold A/B
    return int(nir[13:]) == 97 - int(body) % 97


def _national_id_valid(candidate: str) -> bool:
    if candidate[0].isalpha():
        return _nino_valid(candidate)
    return _ssn_valid(candidate) if "-" in candidate else _nir_valid(candidate)


def _intl_phone_valid(candidate: str) -> bool:
    return sum(c.isdigit() for c in candidate) >= 9


def _has_digit(candidate: str) -> bool:
    """Real tokens are random, so they contain digits; hyphenated prose after "sk-" does not."""
    return any(c.isdigit() for c in candidate)


# --- patterns -----------------------------------------------------------------------------------
# The lookbehind ("start guard") and the final lookahead ("end guard") of each pattern keep a match
# from beginning or ending inside a longer number or word.
#
# Every pattern starts with a literal or a character class and only then looks behind that first
# character: r"[0-9](?<![\w.][0-9])" reads "a digit not preceded by a word character or a dot".
# That order is for speed. re skips ahead in C to the next position where the first character can
# match only when the pattern begins with a literal or a class; a leading lookbehind makes it try
# every position (~200 us per pattern on an 8,000-character prompt). A literal start ("sk-", "@")
# costs ~5 us, a class start ~50-80 us, which is why the class-led patterns are few.
#
# Digits are written [0-9], not \d: ids are ASCII, and \d would also accept other scripts' digits.

# "@" first (the rarest character); the local part is found by walking back (see _EmailDetector).
_EMAIL_DOMAIN = r"""
    @ (?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+ ([A-Za-z]{2,63})
    (?![A-Za-z0-9-])
"""
_EMAIL_LOCAL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._%+-")


def _is_local_char(ch: str) -> bool:
    """ASCII atom characters, plus any letter or digit: "élodie@exemple.fr" is one address (RFC 6531),
    not "lodie@exemple.fr"."""
    return ch in _EMAIL_LOCAL_CHARS or ch.isalnum()


# File names like "icon@2x.png" have an e-mail's shape; these "TLDs" are file extensions.
_NOT_TLDS = frozenset({"png", "jpg", "jpeg", "gif", "svg", "webp", "bmp", "ico"})

# "+" country code, then 7..12 more digits (E.164 allows 15 in all), one optional separator
# before each digit and an optional "(0)" / "(202)" group: "+33 6 12 34 56 78", "+442071838750".
# _intl_phone_valid then asks for 9 digits in all, which real numbers have and "+10 20 30 40" not.
_PHONE_INTL = r"""
    \+ (?<![\w+]\+)
    [1-9][0-9]{0,2} (?:[ .-]?\([0-9]{1,4}\))? (?:[ .-]?[0-9]){7,12}
    (?!\w|[.,-][0-9])
"""

# North American Numbering Plan: area code and exchange start with 2-9 and the two separators
# are the same: "202-555-0143", "202.555.0143", "(202) 555-0143". A leading "1-" ("1-800-...")
# is allowed but not part of the span.
_PHONE_NANP = r"""
    [(2-9]
    (?<![\w+.,][(2-9])          # not glued to a word, a sign or a decimal point
    (?<![^1][-.][(2-9])         # after "-" or "." only as "1-800-..."
    (?<![\w+.,-]1[-.][(2-9])    # ... with that "1" standing alone
    (?: (?<=\()[2-9][0-9]{2}\)\ ?[2-9][0-9]{2}[-.]
      | (?<=[2-9])[0-9]{2}([-.])[2-9][0-9]{2}\1 )
    [0-9]{4}
    (?!\w|[.,-][0-9])
"""

# French national format: 0 + 9 digits in five pairs with one consistent separator.
_PHONE_FR = r"""
    0 (?<![\w+.,-]0)
    [1-9]([ .-])[0-9]{2}(?:\1[0-9]{2}){3}
    (?!\w|[.,-][0-9])
"""

# 2 letters, 2 check digits, then 11..30 alphanumerics, optionally in groups of four. Upper case
# only: that is how IBANs are written, and lower-case words would otherwise be swallowed.
_IBAN = r"""
    [A-Z] (?<![A-Za-z0-9][A-Z])
    [A-Z][0-9]{2} (?:\ ?[A-Z0-9]{4}){2,7} (?:\ ?[A-Z0-9]{1,4})?
    (?![A-Za-z0-9])
"""

# Either one run of 13-19 digits, or the printed groupings 4-4-4-4(-3) and 4-6-5 / 4-6-4 (Amex,
# Diners) with one consistent separator. A separator between arbitrary digits is not accepted.
_CARD = r"""
    [0-9] (?<![\w+][0-9]) (?<![0-9][.,-][0-9])
    (?: [0-9]{12,18}
      | [0-9]{3}([ -])[0-9]{4}\1[0-9]{4}\1[0-9]{4}(?:\1[0-9]{3})?
      | [0-9]{3}([ -])[0-9]{6}\2[0-9]{4,5} )
    (?!\w|[.,-][0-9])
"""

# One pattern for the three national ids (one pass over the text instead of three); they cannot
# start at the same place, and _national_id_valid tells them apart by shape.
_NATIONAL_ID = r"""
    [0-9A-Z] (?<![\w.,-][0-9A-Z])
    (?: (?<=[0-9]) [0-9]{2}-[0-9]{2}-[0-9]{4}               # US SSN, dashed only: 123-45-6789
      | (?<=[A-Z]) [A-Z]\ ?[0-9]{2}\ ?[0-9]{2}\ ?[0-9]{2}\ ?[A-D]   # UK NINO: QQ 12 34 56 C, AB123456C
      | (?<=[1-478])                                         # FR NIR: sex, year, month, department
        \ ?[0-9]{2}\ ?[0-9]{2}\ ?(?:(?:[0-9]{2}|2[AB])\ ?[0-9]{3}|[0-9]{3}\ ?[0-9]{2})  # + commune
        \ ?[0-9]{3}\ ?[0-9]{2} )                             # order number, key
    (?!\w|[.,-][0-9])
"""

_SECRETS: tuple[tuple[str, Callable[[str], bool] | None], ...] = (
    # OpenAI (also sk-proj-, sk-svcacct-) and other "sk-" keys.
    (r"sk-(?<![\w-]sk-)[A-Za-z0-9_-]{20,}", _has_digit),
    # AWS access key id (long-term AKIA, temporary ASIA).
    (r"A[KS]IA(?<![A-Za-z0-9]A[KS]IA)[A-Z0-9]{16}(?![A-Za-z0-9])", None),
    # GitHub personal, OAuth, user-to-server, server-to-server and refresh tokens; fine-grained PATs.
    (r"gh[pousr]_(?<![A-Za-z0-9_]gh[pousr]_)[A-Za-z0-9]{30,}", None),
    (r"github_pat_(?<![A-Za-z0-9_]github_pat_)[A-Za-z0-9_]{22,}", None),
    # Slack bot / user / app / refresh / legacy tokens.
    (r"xox[abprs]-(?<![\w-]xox[abprs]-)[A-Za-z0-9-]{10,}", _has_digit),
    # Google API key.
    (r"AIza(?<![\w-]AIza)[0-9A-Za-z_-]{35}(?![\w-])", None),
    # PEM / OpenSSH / PGP private key; the span covers the whole block when its END line is there.
    # "( BLOCK|)" rather than "( BLOCK)?": a backreference to a group that did not match fails.
    # The body stops at the next "-----", so a BEGIN without END costs a short look, not the rest
    # of the text (which would make many BEGIN lines quadratic).
    (
        r"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY( BLOCK|)-----"
        r"(?:(?:(?!-----)[\s\S])*-----END \1PRIVATE KEY\2-----)?",
        None,
    ),
    # Any bearer token of 32+ characters (an Authorization header pasted into a prompt).
    # Two literal patterns rather than [Bb], which would make re test every position (see above).
    (r"Bearer(?<![\w-]Bearer)[ \t]+[A-Za-z0-9._~+/=-]{32,}", _has_digit),
    (r"bearer(?<![\w-]bearer)[ \t]+[A-Za-z0-9._~+/=-]{32,}", _has_digit),
)


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.VERBOSE)


class _EmailDetector(RegexDetector):
    """Matches "@domain.tld", then walks back over the local part (at most 64 characters).

    Starting from "@" instead of the local part keeps the scan fast: almost no position in
    ordinary text is an "@", while almost every one could start a local part.
    """

    __slots__ = ()

    def _accept(self, match: re.Match[str]) -> Finding | None:
        text, at = match.string, match.start()
        start = at
        while start > 0 and at - start < 64 and _is_local_char(text[start - 1]):
            start -= 1
        if start > 0 and _is_local_char(text[start - 1]):
            return None  # a local part longer than 64 characters is not an address
        while start < at and text[start] == ".":
            start += 1  # a local part does not start with a dot ("see...john@x.org")
        if start == at or match.group(1).lower() in _NOT_TLDS:
            return None
        return Finding(self.kind, start, match.end())


class _IbanDetector(RegexDetector):
    """IBAN candidates are trimmed to the country's registered length before the mod-97 check.

    The candidate regex cannot know where an IBAN ends, so a following group-sized token
    ("BE68 5390 0754 7034 EUR") would otherwise be swallowed and make a valid IBAN fail.
    """

    __slots__ = ()

    def _accept(self, match: re.Match[str]) -> Finding | None:
        text = match.group()
        expected = _IBAN_LENGTHS.get(text[:2])
        end = len(text)
        if expected is not None:
            seen = 0
            for i, ch in enumerate(text):
                if ch != " ":
                    seen += 1
                    if seen == expected:
                        end = i + 1
                        break
            # The registered length must end on a group boundary, not inside a longer token.
            if end < len(text) and text[end] != " ":
                return None
        if iban_valid(text[:end]):
            return Finding(self.kind, match.start(), match.start() + end)
        return None


BUILTIN_KINDS: tuple[str, ...] = ("email", "phone", "iban", "credit_card", "national_id", "api_secret")

_BUILTINS: dict[str, tuple[RegexDetector, ...]] = {
    "email": (_EmailDetector("email", _compile(_EMAIL_DOMAIN)),),
    "phone": (
        RegexDetector("phone", _compile(_PHONE_INTL), _intl_phone_valid),
        RegexDetector("phone", _compile(_PHONE_NANP)),
        RegexDetector("phone", _compile(_PHONE_FR)),
    ),
    "iban": (_IbanDetector("iban", _compile(_IBAN)),),
    "credit_card": (RegexDetector("credit_card", _compile(_CARD), _card_valid),),
    "national_id": (RegexDetector("national_id", _compile(_NATIONAL_ID), _national_id_valid),),
    "api_secret": tuple(RegexDetector("api_secret", re.compile(p), v) for p, v in _SECRETS),
}


def builtin_detectors(kinds: Iterable[str] | None = None) -> list[Detector]:
    """The built-in detectors for the given kinds (all when None); unknown kind -> ValueError naming it.

    A kind may be served by several detectors (phone: international, North American, French);
    they all report that kind. Detectors are stateless and shared, so this is cheap per request.
    """
    if kinds is None:
        wanted: tuple[str, ...] = BUILTIN_KINDS
    else:
        wanted = (kinds,) if isinstance(kinds, str) else tuple(kinds)  # one kind given as a bare str
    unknown = [k for k in wanted if k not in _BUILTINS]
    if unknown:
        raise ValueError(
            f"unknown detector kind(s): {', '.join(map(repr, unknown))}; known: {', '.join(BUILTIN_KINDS)}"
        )
    return [d for kind in dict.fromkeys(wanted) for d in _BUILTINS[kind]]


def scan(texts: Iterable[str], detectors: Sequence[Detector], first_only: bool = True) -> list[Finding]:
    """Run detectors over texts. With first_only=True, stop a detector after its first finding
    (the engine only needs to know a kind is present) — and skip detectors already found.

    "Already found" is per kind: once any detector of a kind has fired, the other detectors of
    that kind are skipped for the remaining texts too, and scanning ends when every kind is found.
    The result then holds at most one finding per kind, in the order they were found.

    With first_only=False every finding is returned, text by text and by start offset within a
    text; a finding inside a longer one of the same kind is dropped ("+1 (202) 555-0143" is one
    phone, not also "(202) 555-0143"). Offsets are relative to the text a finding came from.
    """
    findings: list[Finding] = []
    if not first_only:
        for text in texts:
            found = sorted((f for d in detectors for f in d.find(text)), key=lambda f: (f.start, -f.end))
            reach: dict[str, int] = {}  # per kind, the furthest end so far; everything before starts earlier
            for f in found:
                if f.end > reach.get(f.kind, -1):
                    findings.append(f)
                    reach[f.kind] = f.end
        return findings

    pending = {d.kind for d in detectors}
    for text in texts:
        for detector in detectors:
            if detector.kind not in pending:
                continue
            find_first = getattr(detector, "find_first", None)
            if find_first is not None:
                finding = find_first(text)
            else:
                found = detector.find(text)
                finding = found[0] if found else None
            if finding is not None:
                findings.append(finding)
                pending.discard(detector.kind)
        if not pending:
            break
    return findings
