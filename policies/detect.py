"""Data-class detection: does a request's text contain PII or secrets, and of which kind?

The policy engine maps detector kinds to data classes and lets the strictest class found decide
which workers may see the request; this module only says which kinds are present and where.
A false negative sends personal data or a credential to a worker the operator ruled out, so the
detectors lean towards catching; a false positive only narrows the pool, but on ordinary text
(dates, prices, versions, order numbers) it would narrow it for no reason, so every pattern is
anchored on separators, prefixes, check digits or context words rather than on bare runs of digits.

Evasion. A client (or a prompt it forwards) can write the same number in many ways that a model
still reads as that number: full-width or Arabic-Indic digits, zero-width characters inside it,
an en dash instead of a hyphen, dots instead of spaces. `scan` therefore matches on a normalised
copy of each text (`normalise`: NFKC, format and combining characters dropped, every decimal digit
made ASCII, every dash "-", every space " "), and reports offsets in the original text.

Speed. Detection runs on every request, sometimes over megabytes (it runs off the event loop
for large bodies, but a tenant's request should still not cost seconds). Python's `re` pays for
every position where a pattern's first character matches, and for every match it hands back, so
on number-heavy text digit-led patterns are what cost. All digit-led kinds (cards, national ids,
national phones, IBANs, NINOs) are therefore found by ONE pattern (`_DIGIT_LED`) that takes a
whole cluster of digit groups per match, shared by their detectors and cached per text; patterns
with a literal start (secrets, "@", "+", "(") start where str.find first sees their literal;
context words ("ssn", "aws", "secret") are looked up with str.find on a lower-cased copy. Every
pattern is linear: bounded repetitions, possessive where a cluster is consumed, no nested
unbounded quantifiers. bench/policy.py measures time per MB against a plain `re` pass.

Standard library only.
"""

from __future__ import annotations

import base64
import binascii
import html
import re
import threading
import unicodedata
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from io import BytesIO
from typing import Protocol
from urllib.parse import unquote


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


# --- normalisation ------------------------------------------------------------------------------

# Characters NFKC leaves alone but that read as a separator between digit groups.
_DASHES = frozenset("\u2212\u2043\u2e3a\u2e3b\u30fc\uff70")  # minus sign, hyphen bullet, long dashes
_DOTS = frozenset("\u00b7\u2022\u2027\u2219\u22c5\u30fb\u3002\u0701\u0702")  # middle dots, bullets
_SLASHES = frozenset("\u2044\u2215\u29f8")
# Letters that render as nothing (Hangul fillers, braille blank): invisible like format characters.
_INVISIBLE = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def _fold_one(ch: str) -> str:
    """One character of NFKC output mapped to what detection reads (no NFKC: already applied)."""
    if ch in _INVISIBLE:
        return ""
    category = unicodedata.category(ch)
    if category in ("Cf", "Mn", "Me"):  # zero-width, bidi, soft hyphen, combining marks
        return ""
    if category == "Cc":
        if ch in "\t\n\r":
            return ch
        return "\n" if ch == "\x85" else ""
    if category == "Nd":
        return chr(48 + unicodedata.decimal(ch))
    if category == "Zs":
        return " "
    if category in ("Zl", "Zp"):
        return "\n"
    if category == "Pd" or ch in _DASHES:
        return "-"
    if ch in _DOTS:
        return "."
    if ch in _SLASHES:
        return "/"
    return ch


def _fold(ch: str) -> str:
    return "".join(_fold_one(c) for c in unicodedata.normalize("NFKC", ch))


class _FoldTable(dict[int, str]):
    """str.translate table: code point -> folded text, computed on first sight and kept.

    Filling it lazily costs one `_fold` per distinct character ever seen (a few thousand at most);
    a racing thread at worst computes the same value twice.
    """

    def __missing__(self, code: int) -> str:
        folded = _fold(chr(code))
        self[code] = folded
        if len(folded) != 1:
            _UNEVEN.add(chr(code))
        return folded


_FOLD = _FoldTable()
_UNEVEN: set[str] = set()  # characters whose folding is not exactly one character


class Normalised:
    """A text as detection reads it, and the way back to the original's offsets.

    The way back is only built when asked (`original`): most texts hold no finding, and those that
    do need it for a handful of offsets. It is a list of anchors: from normalised offset norm[k] on,
    offsets map to orig[k] plus the distance. A text whose characters all map one to one needs none.
    """

    __slots__ = ("text", "_source", "_uneven", "_norm", "_orig")

    def __init__(self, text: str, source: str | None = None, uneven: frozenset[str] = frozenset()) -> None:
        self.text = text
        self._source = source if uneven else None  # only characters that vanish or grow move offsets
        self._uneven = uneven
        self._norm: list[int] = []
        self._orig: list[int] = []

    def _anchor(self) -> None:
        source = self._source
        assert source is not None
        norm, orig = [0], [0]
        shift = 0  # normalised minus original offset, so far
        for match in _runs_of(self._uneven).finditer(source):
            for offset, ch in enumerate(match.group()):
                at = match.start() + offset
                out = len(_FOLD[ord(ch)])
                for j in range(1, out):  # inside an expansion: still that character
                    norm.append(at + shift + j)
                    orig.append(at)
                shift += out - 1
                norm.append(at + 1 + shift)
                orig.append(at + 1)
        self._norm, self._orig = norm, orig

    def original(self, i: int) -> int:
        if self._source is None:
            return i
        if not self._norm:
            self._anchor()
        # Several anchors at one normalised offset (characters dropped in a row): the last one wins.
        k = bisect_right(self._norm, i) - 1
        return self._orig[k] + (i - self._norm[k])

    def restore(self, finding: Finding) -> Finding:
        """The finding with offsets in the original text (a dropped character inside stays inside)."""
        if self._source is None:
            return finding
        end = self.original(finding.end - 1) + 1 if finding.end > finding.start else finding.start
        return Finding(finding.kind, self.original(finding.start), end)


_PLAIN_ASCII = bytes(range(0x20, 0x7F)) + b"\t\n\r"
_MANY = 8  # above this many distinct characters to replace, one pass over runs beats str.replace each


@lru_cache(maxsize=256)
def _runs_of(chars: frozenset[str]) -> re.Pattern[str]:
    return re.compile("[" + "".join(re.escape(c) for c in sorted(chars)) + "]+")


def normalise(text: str) -> Normalised:
    """What detection reads: NFKC; format characters (zero-width, bidi, soft hyphen), combining
    marks and control characters dropped; decimal digits of every script as ASCII; dashes "-";
    spaces " ".

    Work is proportional to what must change, and done by C loops: printable ASCII is returned as
    is, without a copy, and so is text whose characters all read as themselves (most prose in any
    script); otherwise each distinct character that changes is replaced with one str.replace (or,
    when there are many, the runs of changing characters are translated). Folding is per
    character: a combining mark dropped this way leaves its base letter, which is all detection
    needs; it also keeps the way back to original offsets simple (see Normalised).
    """
    if text.isascii() and not text.encode("ascii").translate(None, _PLAIN_ASCII):
        return Normalised(text)
    changing = frozenset(
        c
        for c in set(text)
        if not (c.isascii() and (c.isprintable() or c in "\t\n\r")) and _FOLD[ord(c)] != c
    )
    if not changing:
        return Normalised(text)
    uneven = changing.intersection(_UNEVEN)
    if len(changing) <= _MANY:
        folded = text
        for c in changing:
            folded = folded.replace(c, _FOLD[ord(c)])
    else:
        pieces: list[str] = []
        done = 0
        for match in _runs_of(changing).finditer(text):
            pieces.append(text[done : match.start()])
            pieces.append(match.group().translate(_FOLD))
            done = match.end()
        pieces.append(text[done:])
        folded = "".join(pieces)
    return Normalised(folded, text, uneven)


_JSON_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")
_PERCENT_ESCAPE = re.compile(r"%[0-9a-fA-F]{2}")
_HTML_ENTITY = re.compile(r"&#(?:[0-9]{1,7}|[xX][0-9a-fA-F]{1,6});")
# A base64 data URL (an attached file's file_data, a document's source): its payload, line breaks allowed.
_DATA_URL = re.compile(r"data:[^,;\s]{0,128}(?:;[^,;\s]{1,128}){0,8};base64,([A-Za-z0-9+/=_\-\r\n]+)", re.I)


PDF_MAX_PAGES = 100  # pages of an attached PDF read for detection (a worker reads them all; few send more)


def _pdf_text(raw: bytes) -> str | None:
    """The text layer of an attached PDF, as the worker's provider will extract it; None when it has
    none that can be read (encrypted, damaged, or scanned images: no OCR here)."""
    from pypdf import PdfReader

    try:
        reader = PdfReader(BytesIO(raw), strict=False)
        if reader.is_encrypted:
            return None
        return "\n".join(page.extract_text() or "" for page in reader.pages[:PDF_MAX_PAGES]) or None
    except Exception:  # noqa: BLE001 — pypdf raises many kinds on damaged files; none may fail the request
        return None


def _data_url_texts(text: str) -> list[str]:
    """The readable content of base64 data URLs: UTF-8 text (a text file a worker will read) and a
    PDF's text layer. Other binary payloads (images) are left alone: there is no OCR here."""
    texts = []
    for match in _DATA_URL.finditer(text):
        payload = "".join(match.group(1).split())
        payload += "=" * (-len(payload) % 4)
        try:
            raw = base64.b64decode(payload, altchars=b"-_" if "-" in payload or "_" in payload else None)
        except (binascii.Error, ValueError):  # not base64
            continue
        if raw.startswith(b"%PDF-"):
            found = _pdf_text(raw)
            if found:
                texts.append(found)
            continue
        try:
            texts.append(raw.decode("utf-8"))
        except ValueError:  # binary: an image, an archive
            continue
    return texts


def decoded_views(text: str) -> list[str]:
    """The text as it reads once escapes are undone, when it holds any: JSON "\\uXXXX" escapes (tool
    call arguments are JSON inside a string, and json.dumps escapes every non-ASCII character),
    percent-encoding ("jane%40example.com" in a URL), HTML character references ("&#64;"), and
    base64 data URLs holding text or a PDF (an attached file, as OpenAI's file_data sends it).

    A worker reads through these; detection must too. They are extra texts to scan, not a
    replacement: offsets in them mean nothing for the original, and the engine only needs kinds.
    """
    views = []
    if "\\u" in text and _JSON_ESCAPE.search(text):
        views.append(_JSON_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text))
    if "%" in text and _PERCENT_ESCAPE.search(text):
        views.append(unquote(text, errors="replace"))
    if "&#" in text and _HTML_ENTITY.search(text):
        views.append(html.unescape(text))
    if "base64," in text:
        for decoded in _data_url_texts(text):
            views += [decoded, *decoded_views(decoded)]
    return views


# --- check digits -------------------------------------------------------------------------------

_DOUBLED = str.maketrans("0123456789", "0246813579")  # the Luhn digit sum of 2 * d, as a digit


def luhn_valid(digits: str) -> bool:
    """Luhn mod-10 check of a string of ASCII digits (anything else, or fewer than 2, is False)."""
    if len(digits) < 2 or not (digits.isascii() and digits.isdigit()):
        return False
    kept = sum(map(int, digits[-1::-2]))
    doubled = sum(map(int, digits[-2::-2].translate(_DOUBLED)))
    return (kept + doubled) % 10 == 0


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
_IBAN_LETTERS = str.maketrans({c: str(10 + i) for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZ")})


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
    # ISO 7064: A..Z become 10..35, digits stay; the number mod 97 must be 1.
    return int((iban[4:] + iban[:4]).translate(_IBAN_LETTERS)) % 97 == 1


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

_NOT_DIGITS = str.maketrans("", "", " .-/()")


def _digits(candidate: str) -> str:
    return candidate.translate(_NOT_DIGITS)


def _card_number_valid(digits: str) -> bool:
    known_issuer = any(
        lo <= digits[: len(lo)] <= hi and len(digits) in lengths for lo, hi, lengths in _CARD_ISSUERS
    )
    return known_issuer and luhn_valid(digits)


def _card_valid(candidate: str) -> bool:
    return _card_number_valid(_digits(candidate))


# US SSN: area not 000, 666 or 9xx (never issued), group not 00, serial not 0000.
def _ssn_digits_valid(digits: str) -> bool:
    area, group, serial = digits[:3], digits[3:5], digits[5:]
    return (
        len(digits) == 9
        and area not in ("000", "666")
        and area[0] != "9"
        and group != "00"
        and serial != "0000"
    )


def _ssn_valid(candidate: str) -> bool:
    return _ssn_digits_valid(_digits(candidate))


# UK NINO prefixes: HMRC never uses D F I Q U V as first letter, D F I O Q U V as second, nor the
# pairs below. "QQ" is HMRC's published specimen (QQ 12 34 56 C), not a real allocation; it is
# accepted on purpose so that prompts quoting the specimen, and tests, behave like real numbers.
_NINO_UNALLOCATED = frozenset({"BG", "GB", "KN", "NK", "NT", "TN", "ZZ"})


def _nino_valid(candidate: str) -> bool:
    first, second = candidate[0].upper(), candidate[1].upper()
    if first + second == "QQ":
        return True
    return first not in "DFIQUV" and second not in "DFIOQUV" and first + second not in _NINO_UNALLOCATED


def _nir_valid(candidate: str) -> bool:
    """French NIR: plausible month, then key == 97 - (first 13 digits mod 97).

    Corsican departments 2A/2B count as 19/18 for the key (INSEE rule). Months 20, 30-42 and
    50-99 are issued to people whose birth month is unknown, so they are valid too.
    """
    nir = candidate.replace(" ", "").upper()
    month = int(nir[3:5])
    if not (1 <= month <= 12 or month == 20 or 30 <= month <= 42 or month >= 50):
        return False
    body = nir[:13].replace("2A", "19", 1).replace("2B", "18", 1)  # only the department can hold A/B
    return int(nir[13:]) == 97 - int(body) % 97


def _phone_digits(low: int, high: int) -> Callable[[str], bool]:
    def valid(candidate: str) -> bool:
        return low <= sum(c.isdigit() for c in candidate) <= high

    return valid


_intl_phone_valid = _phone_digits(9, 15)


def _has_digit(candidate: str) -> bool:
    """Real tokens are random, so they contain digits; hyphenated prose after "sk-" does not."""
    return any(c.isdigit() for c in candidate)


def _mixed_token(candidate: str) -> bool:
    """A random base64 token: upper and lower case letters and a digit, "/" or "+". A hex digest
    (one case) or an identifier in prose is not one."""
    return (
        any(c.isupper() for c in candidate)
        and any(c.islower() for c in candidate)
        and any(c.isdigit() or c in "/+" for c in candidate)
    )


# --- detectors ----------------------------------------------------------------------------------


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


# --- patterns -----------------------------------------------------------------------------------
# The lookbehind ("start guard") and the final lookahead ("end guard") of each pattern keep a match
# from beginning or ending inside a longer number or word.
#
# Every pattern starts with a literal or a character class and only then looks behind that first
# character: r"[0-9](?<![\w.][0-9])" reads "a digit not preceded by a word character or a dot".
# That order is for speed. re skips ahead in C to the next position where the first character can
# match only when the pattern begins with a literal or a class; a leading lookbehind makes it try
# every position. A literal start ("sk-", "@") costs ~1 ms per MB, a class start much more on text
# where the class is frequent, which is why all digit-led kinds share one pattern (see below).
#
# Patterns run on normalised text, so [0-9] covers every script's digits, "-" every dash and " "
# every space; zero-width characters are gone.

# "@" first (the rarest character); the local part is found by walking back (see _EmailDetector).
# Domain labels may hold any letter (internationalised domains, and look-alike letters).
_EMAIL_DOMAIN = r"""
    @ (?:[^\W_](?:[\w-]{0,61}[^\W_])?\.)+ ([^\W\d_]{2,63})
    (?![\w-])
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
    [1-9][0-9]{0,2} (?:[ ./-]?\([0-9]{1,4}\))? (?:[ ./-]?[0-9]){7,12}
    (?!\w|[.,-][0-9])
"""

# A card's digit groups may be separated by a space, a dot or a dash, each optionally spaced
# (" - "), and mixed: "4111.1111 1111-1111". Zero-width characters are already gone.
_S = r"(?:\ ?[.-]\ ?|\ )"

# The digit-led kinds are found by one pass of one pattern (_DIGIT_LED), built from the
# alternatives below: (group name, kind, validator, pattern). Each pattern is written as the text
# AFTER the first digit, which the combined pattern has already consumed; lookbehinds therefore
# see that digit as their last character. Guards used below:
#   GLUE  - the number does not continue a decimal ("1.4111"); the combined pattern already
#           refuses a number glued to a word or a sign ("x4111", "+4111")
#   LONE  - not after "-", "." or "," either (a phone or id is not the tail of a range or list)
#   END   - not followed by a word character or a decimal part
#   ISO   - (shapes of small groups without a check digit) not followed by another group either,
#           so that a table of two-digit numbers never reads as a phone number. Their start is
#           isolated the same way: they are only tried at the start of a cluster (see _DIGIT_LED).
_GLUE = r"(?<![0-9][.,-][0-9])"
_LONE = r"(?<![.,-][0-9])"
_END = r"(?!\w|[.,-][0-9])"
_ISO = r"(?!\w|[.,-][0-9]|\ ?[./-]?\ ?[0-9])"
# What separates the digit groups of one cluster: a space, dot, slash or dash, optionally spaced.
_GAP = r"(?:\ ?[./-]\ ?|\ )"

Alternative = tuple[str, str, "Callable[[str], bool] | None", str]

# Shapes tried only where a cluster of digit groups starts.
_ISOLATED: tuple[Alternative, ...] = (
    # US SSN written with dashes: 123-45-6789. (Other separators need a context word: _SSN_CONTEXT.)
    ("ssn", "national_id", _ssn_valid, rf"{_LONE}[0-9]{{2}}-[0-9]{{2}}-[0-9]{{4}}{_END}"),
    # French NIR: sex, year, month, department (2A/2B in Corsica), commune, order number, key.
    (
        "nir",
        "national_id",
        _nir_valid,
        rf"""(?<=[1-478]){_LONE}
        \ ?[0-9]{{2}}\ ?[0-9]{{2}}\ ?(?:(?:[0-9]{{2}}|2[ABab])\ ?[0-9]{{3}}|[0-9]{{3}}\ ?[0-9]{{2}})
        \ ?[0-9]{{3}}\ ?[0-9]{{2}}{_ISO}""",
    ),
    # North American Numbering Plan: 202-555-0143, 202.555.0143, 202 555-0143 (not three bare
    # space-separated groups: that is any table; not "202.555 0143": that is a decimal and a
    # number). Area code and exchange start with 2-9.
    (
        "nanp",
        "phone",
        None,
        rf"""(?<=[2-9]){_LONE}
        [0-9]{{2}} (?: -[2-9][0-9]{{2}}[-\ ] | \.[2-9][0-9]{{2}}\. | \ [2-9][0-9]{{2}}- ) [0-9]{{4}}{_ISO}""",
    ),
    # The same after a lone "1-" ("1-800-555-0199"), which is not part of the span.
    (
        "nanp_1",
        "phone",
        None,
        rf"""(?<=(?<![\w+.,-])1)
        (?: -[2-9][0-9]{{2}}-[2-9][0-9]{{2}}- | \.[2-9][0-9]{{2}}\.[2-9][0-9]{{2}}\. ) [0-9]{{4}}{_ISO}""",
    ),
    # French national format: 0 + 9 digits in five pairs, "06 12 34 56 78", "06.12-34 56.78".
    ("fr_phone", "phone", None, rf"(?<=0){_LONE}[1-9](?:[ .-][0-9]{{2}}){{4}}{_ISO}"),
    # Other European national formats with a trunk "0": UK "07700 900123", "020 7183 8750",
    # "0161 496 0000"; German "030 1234567", "030/12345678", "0221 123 4567". An area code of
    # 3-6 digits, then the subscriber in one or two groups; 10-12 digits in all.
    (
        "eu_phone",
        "phone",
        _phone_digits(10, 12),
        rf"""(?<=0){_LONE}[1-9][0-9]{{1,4}}
        (?: (?:/|\ ?-\ ?|\ )[1-9][0-9]{{3,7}}
          | [\ -][0-9]{{3,4}}[\ -][0-9]{{3,4}} ){_ISO}""",
    ),
)

# UK NINO with a space after the letters: QQ 12 34 56 C, JG 103749 D (its digits start a cluster).
_NINO_SPACED: Alternative = (
    "nino_spaced",
    "national_id",
    _nino_valid,
    rf"(?<=(?<![\w.,-])[A-Za-z]{{2}}\ [0-9])[0-9]\ ?[0-9]{{2}}\ ?[0-9]{{2}}\ ?[A-Da-d]{_END}",
)


def _cards(suffix: str = "") -> tuple[Alternative, ...]:
    """Cards: 13-19 digits in one run, or 4-4-4-4(-1..3) groups (4-4-4-1 for 13 digits), or 4-6-4(5)
    (Amex, Diners). Luhn and the issuer table keep a table of numbers from reading as cards."""
    return (
        ("card_run" + suffix, "credit_card", _card_valid, rf"(?<=[2-6]){_GLUE}[0-9]{{12,18}}{_END}"),
        (
            "card_groups" + suffix,
            "credit_card",
            _card_valid,
            rf"(?<=[2-6]){_GLUE}[0-9]{{3}}(?:{_S}[0-9]{{4}}){{2}}{_S}[0-9]{{1,4}}(?:{_S}[0-9]{{1,3}})?{_END}",
        ),
        (
            "card_amex" + suffix,
            "credit_card",
            _card_valid,
            rf"(?<=3){_GLUE}[0-9]{{3}}{_S}[0-9]{{6}}{_S}[0-9]{{4,5}}{_END}",
        ),
    )


_CARDS = _cards()
_CARDS_FURTHER = _cards("_further")  # the same, found after other groups of the cluster

# Shapes whose first digit follows letters: the IBAN's check digits, the NINO's digits.
_AFTER_LETTERS: tuple[Alternative, ...] = (
    # 2 letters, 2 check digits, then 11..30 alphanumerics, in groups of four or not, with spaces,
    # dashes or dots, in either case: "DE89 3704 0044 0532 0130 00", "de89-3704-0044-0532-0130-00".
    (
        "iban",
        "iban",
        None,
        r"""(?<=(?<![A-Za-z0-9])[A-Za-z]{2}[0-9])
        [0-9] (?:[\ .-]?[A-Za-z0-9]{4}){2,7} (?:[\ .-]?[A-Za-z0-9]{1,4})?
        (?![A-Za-z0-9])""",
    ),
    # UK NINO written as one token: AB123456C.
    (
        "nino",
        "national_id",
        _nino_valid,
        rf"(?<=(?<![\w.,-])[A-Za-z]{{2}}[0-9])[0-9]\ ?[0-9]{{2}}\ ?[0-9]{{2}}\ ?[A-Da-d]{_END}",
    ),
)

# "(" phones: "(202) 555-0143" (any exchange: the parentheses are evidence enough), "(030) 1234567".
_PARENS: tuple[Alternative, ...] = (
    ("nanp_paren", "phone", None, r"(?<![\w(]\()[2-9][0-9]{2}\)\ ?[0-9]{3}[-.\ ][0-9]{4}" + _END),
    (
        "eu_paren",
        "phone",
        _phone_digits(10, 12),
        r"(?<![\w(]\()0[1-9][0-9]{1,4}\)\ ?[1-9][0-9]{2,7}(?:[\ -][0-9]{3,4})?" + _END,
    ),
)


def _alternation(alternatives: Sequence[Alternative]) -> str:
    return "|".join(f"(?P<{name}>{pattern})" for name, _, _, pattern in alternatives)


# One pass for every digit-led kind. re pays for every position it tries, and on number-heavy
# text almost every position is a digit; so at the first digit of a long cluster of digit groups
# (digits joined by _GAP) the match either finds a shape or consumes the whole cluster as "nothing
# here", and re never tries the positions inside it. (A short cluster is left to fail instead:
# trying its few inner digits costs less than handing back a match.) Only the start of a cluster is tried: a table of numbers holds
# every phone shape somewhere, and a shape glued to other numbers is not what people write.
# Cards are also tried after one or two leading groups ("exp 12/26 4111 1111 1111 1111",
# "0 4111 ..."): they have check digits, and the leading groups are the obvious evasion.
_CLUSTER_START = r"(?<![\w+][0-9]) (?<![0-9][\ ./-][0-9]) (?<![0-9]\ [./-]\ [0-9])"
_FURTHER_GROUPS = 2
_DIGIT_LED = re.compile(
    rf"""
    [0-9]
    (?: {_CLUSTER_START} (?=[0-9A-Da-d\ ./-]{{6}})  # every shape has that much after its first digit
        (?: {_alternation([_NINO_SPACED])}
          | (?=[0-9A-Da-d\ ./-]{{8}}) (?: {_alternation(_ISOLATED)} | {_alternation(_CARDS)} )
          | [0-9]*+ {_GAP} (?: [0-9]++ {_GAP} ){{0,{_FURTHER_GROUPS - 1}}}? [0-9] (?: {_alternation(_CARDS_FURTHER)} )
          | (?=[0-9\ ./-]{{12}}) [0-9]*+ (?: {_GAP} [0-9]++ )*+ )
      | (?<=[A-Za-z][0-9]) (?: {_alternation(_AFTER_LETTERS)} ) )
    """,
    re.VERBOSE,
)
_NEXT_GROUP = re.compile(rf"[0-9]*+ {_GAP} (?=[0-9])", re.VERBOSE)
_CARD_HERE = re.compile(rf"[0-9] (?: {_alternation(_CARDS_FURTHER)} )", re.VERBOSE)
_CLUSTER_END = re.compile(rf"[0-9]*+ (?: {_GAP} [0-9]++ )*+", re.VERBOSE)
_PAREN_LED = re.compile(rf"\( (?: {_alternation(_PARENS)} )", re.VERBOSE)

_AT_START = (_NINO_SPACED, *_ISOLATED, *_CARDS)
_ALTERNATIVES = {a[0]: a for a in (*_AT_START, *_CARDS_FURTHER, *_AFTER_LETTERS, *_PARENS)}
# The same alternatives one by one, for the rare candidate that fails its validator: a later
# alternative may still match at that place (a 15-digit run that is no NIR may be an Amex).
_ALONE = {name: re.compile(f"[0-9(](?:{a[3]})", re.VERBOSE) for name, a in _ALTERNATIVES.items()}
_LATER: dict[str, tuple[str, ...]] = {name: () for name in _ALTERNATIVES}
for _group in (_AT_START, _CARDS_FURTHER, _AFTER_LETTERS, _PARENS):
    _LATER.update({a[0]: tuple(b[0] for b in _group[i + 1 :]) for i, a in enumerate(_group)})
# Four card groups exactly: "4111 1111 1111 1111 12" is a card followed by a number, not a
# 19-digit card that fails its check digit.
_CARD_FOUR_GROUPS = re.compile(rf"[0-9]{{4}}(?:{_S}[0-9]{{4}}){{3}}", re.VERBOSE)


_IBAN_SEPARATORS = str.maketrans("", "", " .-")


@lru_cache(maxsize=64)
def _iban_prefix(length: int) -> re.Pattern[str]:
    """The first `length` IBAN characters of a candidate, separators between them included."""
    return re.compile(rf"(?:[ .-]?[A-Za-z0-9]){{{length}}}")


def _iban_span(text: str, start: int, end: int) -> tuple[int, int] | None:
    """The IBAN starting at `start` (its country code), trimmed to the country's registered length.

    The candidate regex cannot know where an IBAN ends, so a following group-sized token
    ("BE68 5390 0754 7034 EUR") would otherwise be swallowed and make a valid IBAN fail.
    Lower-case or separated by dashes/dots, only a registered country counts: "ab12 cdef ..."
    would otherwise pass one time in 97.
    """
    candidate = text[start:end]
    expected = _IBAN_LENGTHS.get(candidate[:2].upper())
    if expected is None:
        plain = candidate.isupper() and "-" not in candidate and "." not in candidate
        return (start, end) if plain and iban_valid(candidate) else None
    compact = candidate.translate(_IBAN_SEPARATORS)
    if len(compact) < expected or not iban_valid(compact[:expected]):
        return None
    stop = _iban_prefix(expected).match(candidate)
    assert stop is not None  # the candidate holds `expected` characters, each optionally separated
    # The registered length must end on a group boundary, not inside a longer token.
    if stop.end() < len(candidate) and candidate[stop.end()] not in " .-":
        return None
    return start, start + stop.end()


class _NumericScan:
    """The one pass over a text for every digit-led kind (plus the cheap "(" pass); its result is
    kept for the last text seen in each thread, so the detectors of the four kinds share it."""

    def __init__(self) -> None:
        self._last = threading.local()

    def findings(self, text: str) -> list[Finding]:
        cached = getattr(self._last, "entry", None)
        if cached is not None and cached[0] is text:
            return cached[1]
        found = sorted((*self._digits(text), *self._parens(text)), key=lambda f: f.start)
        self._last.entry = (text, found)
        return found

    def _digits(self, text: str) -> Iterable[Finding]:
        pos = 0
        while (match := _DIGIT_LED.search(text, pos)) is not None:
            name = match.lastgroup
            cluster = match.start()
            if name is None:  # the cluster held no shape and was consumed whole
                pos = max(match.end(), cluster + 1)
                continue
            start = match.start(name) - 1  # the alternatives begin after their first digit
            finding = self._first_valid(text, name, start, match.end())
            if finding is None and not name.startswith(("iban", "nino")):
                finding = self._further_card(text, cluster)
            if finding is None:  # nothing valid in this cluster: skip it whole
                pos = max(_CLUSTER_END.match(text, cluster).end(), cluster + 1)
                continue
            yield finding
            pos = max(finding.end, cluster + 1)

    def _further_card(self, text: str, cluster: int) -> Finding | None:
        """A card after the first or second group of the cluster, when the shape found at its
        start did not validate (the combined pattern stops at the first shape that matches)."""
        pos = cluster
        for _ in range(_FURTHER_GROUPS):
            step = _NEXT_GROUP.match(text, pos)
            if step is None:
                return None
            pos = step.end()
            card = _CARD_HERE.match(text, pos)
            if card is not None and card.lastgroup:
                finding = self._first_valid(text, card.lastgroup, pos, card.end())
                if finding is not None:
                    return finding
        return None

    def _parens(self, text: str) -> Iterable[Finding]:
        pos = 0
        while (match := _PAREN_LED.search(text, pos)) is not None:
            name, start = match.lastgroup or "", match.start()
            finding = self._first_valid(text, name, start, match.end())
            if finding is not None:
                yield finding
            pos = finding.end if finding is not None else start + 1

    def _first_valid(self, text: str, name: str, start: int, end: int) -> Finding | None:
        """The candidate if it validates, else the first later alternative that matches there and does."""
        finding = self._accept(text, name, start, end)
        for other in _LATER[name] if finding is None else ():
            alone = _ALONE[other].match(text, start)
            if alone is not None and (finding := self._accept(text, other, start, alone.end())):
                break
        return finding

    @staticmethod
    def _accept(text: str, name: str, start: int, end: int) -> Finding | None:
        _, kind, validator, _ = _ALTERNATIVES[name]
        if name == "iban":
            span = _iban_span(text, start - 2, end)
            return Finding(kind, *span) if span is not None else None
        if name == "nino":
            start -= 2
        elif name == "nino_spaced":
            start -= 3
        elif name == "nanp_1":
            start += 2
        if validator is None or validator(text[start:end]):
            return Finding(kind, start, end)
        if name.startswith("card_groups") and (four := _CARD_FOUR_GROUPS.match(text, start)):
            if four.end() < end and _card_valid(four.group()):
                return Finding(kind, start, four.end())
        return None


_NUMERIC_SCAN = _NumericScan()


class _NumericDetector:
    """One kind's view of the shared numeric pass."""

    __slots__ = ("kind",)

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def find(self, text: str) -> list[Finding]:
        return [f for f in _NUMERIC_SCAN.findings(text) if f.kind == self.kind]

    def find_first(self, text: str) -> Finding | None:
        return next((f for f in _NUMERIC_SCAN.findings(text) if f.kind == self.kind), None)

    def __repr__(self) -> str:
        return f"_NumericDetector({self.kind!r})"


_LOWERED = threading.local()
_MAX_CONTEXT_HITS = 1024


def _lowered(text: str) -> str:
    """text.lower() with the same offsets, kept for the last text of each thread (the context
    detectors share it)."""
    cached = getattr(_LOWERED, "entry", None)
    if cached is not None and cached[0] is text:
        return cached[1]
    lower = text.lower()
    if len(lower) != len(text):  # a few letters grow when lower-cased (İ): offsets would drift
        lower = "".join(c.lower()[:1] or c for c in text)
    _LOWERED.entry = (text, lower)
    return lower


class _ContextDetector:
    """A shape that is only evidence next to a word saying what it is: an undashed SSN after
    "SSN" or "social security", a 40-character AWS secret key after "aws" or "secret".

    Context words are found with str.find on a lower-cased copy (C speed, no regex start cost);
    the shape is then searched only in the `window` characters after each, windows merged so that
    text repeating the word thousands of times is still scanned once.
    """

    __slots__ = ("kind", "words", "pattern", "window", "reach", "validator")

    def __init__(
        self,
        kind: str,
        words: tuple[str, ...],
        pattern: str,
        window: int,
        validator: Callable[[str], bool] | None = None,
    ) -> None:
        self.kind = kind
        self.words = words
        self.pattern = re.compile(pattern, re.VERBOSE)
        self.window = window
        self.reach = 64  # a match starting inside a window may end this far after it
        self.validator = validator

    def _regions(self, text: str) -> list[tuple[int, int]]:
        lower = _lowered(text)
        hits: list[int] = []
        for word in self.words:
            at = lower.find(word)
            while at != -1:
                before = lower[at - 1] if at else " "
                if not before.isalpha():  # "aws", not "laws"; "ssn", not "classname"
                    hits.append(at)
                    if len(hits) > _MAX_CONTEXT_HITS:  # the word everywhere: search everything after it
                        return [(min(hits), len(text))]
                at = lower.find(word, at + 1)
        hits.sort()
        regions: list[tuple[int, int]] = []
        for at in hits:
            end = at + self.window
            if regions and at <= regions[-1][1]:
                regions[-1] = (regions[-1][0], max(regions[-1][1], end))
            else:
                regions.append((at, end))
        return regions

    def find(self, text: str) -> list[Finding]:
        found = []
        for start, end in self._regions(text):
            for match in self.pattern.finditer(text, start, min(len(text), end + self.reach)):
                if self.validator is None or self.validator(match.group()):
                    found.append(Finding(self.kind, match.start(), match.end()))
        return found

    def find_first(self, text: str) -> Finding | None:
        found = self.find(text)
        return found[0] if found else None

    def __repr__(self) -> str:
        return f"_ContextDetector({self.kind!r}, {self.words!r})"


# An SSN without dashes ("123 45 6789", "123456789", "123.45.6789") within 40 characters after a
# word that names it. Bare nine-digit numbers are far too common (order numbers, ids) to count alone.
_SSN_CONTEXT = _ContextDetector(
    "national_id",
    ("ssn", "social security", "social-security", "soc. sec", "soc sec"),
    r"(?<![\w.,-])[0-9]{3}[\ .-]?[0-9]{2}[\ .-]?[0-9]{4}(?!\w|[.,-][0-9])",
    48,
    _ssn_valid,
)

# AWS secret access key: 40 characters of base64 within 100 characters after "aws" or "secret"
# ("aws_secret_access_key = ...", "SecretAccessKey": "..."). Alone it is indistinguishable from
# any other base64, so the word is required; a hex digest (one case) never counts.
_AWS_SECRET = _ContextDetector(
    "api_secret",
    ("aws", "secret"),
    r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])",
    140,
    _mixed_token,
)

# (needles, pattern, validator): a pattern is only run from the first place one of its literal
# needles occurs (str.find is ~10x faster than re on a literal), and not at all when none does.
_SECRETS: tuple[tuple[tuple[str, ...], str, Callable[[str], bool] | None], ...] = (
    # OpenAI (also sk-proj-, sk-svcacct-), Anthropic (sk-ant-) and other "sk-" keys.
    (("sk-",), r"sk-(?<![\w-]sk-)[A-Za-z0-9_-]{20,}", _has_digit),
    # Stripe live secret and restricted keys.
    (("sk_live_",), r"sk_live_(?<![\w-]sk_live_)[A-Za-z0-9]{16,}", None),
    (("rk_live_",), r"rk_live_(?<![\w-]rk_live_)[A-Za-z0-9]{16,}", None),
    # AWS access key id (long-term AKIA, temporary ASIA).
    (("AKIA", "ASIA"), r"A[KS]IA(?<![A-Za-z0-9]A[KS]IA)[A-Z0-9]{16}(?![A-Za-z0-9])", None),
    # GitHub personal, OAuth, user-to-server, server-to-server and refresh tokens; fine-grained PATs.
    (
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
        r"gh[pousr]_(?<![A-Za-z0-9_]gh[pousr]_)[A-Za-z0-9]{30,}",
        None,
    ),
    (("github_pat_",), r"github_pat_(?<![A-Za-z0-9_]github_pat_)[A-Za-z0-9_]{22,}", None),
    # GitLab personal access token.
    (("glpat-",), r"glpat-(?<![\w-]glpat-)[A-Za-z0-9_-]{20,}", None),
    # Slack bot / user / app / refresh / legacy tokens.
    (("xox",), r"xox[abprs]-(?<![\w-]xox[abprs]-)[A-Za-z0-9-]{10,}", _has_digit),
    # Google API key.
    (("AIza",), r"AIza(?<![\w-]AIza)[0-9A-Za-z_-]{35}(?![\w-])", None),
    # JSON Web Token: base64url header and payload, both JSON objects ("eyJ" is '{"'), signature.
    (("eyJ",), r"eyJ(?<![\w-]eyJ)[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*", None),
    # PEM / OpenSSH / PGP private key; the span covers the whole block when its END line is there.
    # "( BLOCK|)" rather than "( BLOCK)?": a backreference to a group that did not match fails.
    # The body stops at the next "-----", so a BEGIN without END costs a short look, not the rest
    # of the text (which would make many BEGIN lines quadratic).
    (
        ("-----BEGIN ",),
        r"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY( BLOCK|)-----"
        r"(?:(?:(?!-----)[\s\S])*-----END \1PRIVATE KEY\2-----)?",
        None,
    ),
    # Any bearer token of 32+ characters (an Authorization header pasted into a prompt).
    # Two literal patterns rather than [Bb], which would make re test every position (see above).
    (("Bearer",), r"Bearer(?<![\w-]Bearer)[ \t]+[A-Za-z0-9._~+/=-]{32,}", _has_digit),
    (("bearer",), r"bearer(?<![\w-]bearer)[ \t]+[A-Za-z0-9._~+/=-]{32,}", _has_digit),
)


class _NeedleDetector(RegexDetector):
    """A RegexDetector whose pattern starts with one of a few literals: it starts searching where
    the first of them occurs (found by str.find), and skips texts that hold none."""

    __slots__ = ("needles",)

    def __init__(
        self, kind: str, needles: tuple[str, ...], pattern: str, validator: Callable[[str], bool] | None
    ) -> None:
        super().__init__(kind, re.compile(pattern), validator)
        self.needles = needles

    def _from(self, text: str) -> int:
        found = [at for needle in self.needles if (at := text.find(needle)) != -1]
        return min(found) if found else -1

    def find(self, text: str) -> list[Finding]:
        at = self._from(text)
        if at == -1:
            return []
        return [f for f in map(self._accept, self.pattern.finditer(text, at)) if f is not None]

    def find_first(self, text: str) -> Finding | None:
        at = self._from(text)
        if at == -1:
            return None
        for match in self.pattern.finditer(text, at):
            finding = self._accept(match)
            if finding is not None:
                return finding
        return None


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


BUILTIN_KINDS: tuple[str, ...] = ("email", "phone", "iban", "credit_card", "national_id", "api_secret")

_BUILTINS: dict[str, tuple[Detector, ...]] = {
    "email": (_EmailDetector("email", _compile(_EMAIL_DOMAIN)),),
    "phone": (
        RegexDetector("phone", _compile(_PHONE_INTL), _intl_phone_valid),
        _NumericDetector("phone"),
    ),
    "iban": (_NumericDetector("iban"),),
    "credit_card": (_NumericDetector("credit_card"),),
    "national_id": (_NumericDetector("national_id"), _SSN_CONTEXT),
    "api_secret": (*(_NeedleDetector("api_secret", n, p, v) for n, p, v in _SECRETS), _AWS_SECRET),
}


def builtin_detectors(kinds: Iterable[str] | None = None) -> list[Detector]:
    """The built-in detectors for the given kinds (all when None); unknown kind -> ValueError naming it.

    A kind may be served by several detectors (phone: international, and the national formats of
    the shared numeric pass); they all report that kind. Detectors are stateless and shared, so
    this is cheap per request.
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
    """Run detectors over texts, each text normalised first (see `normalise`). With first_only=True,
    stop a detector after its first finding (the engine only needs to know a kind is present) — and
    skip detectors already found.

    "Already found" is per kind: once any detector of a kind has fired, the other detectors of
    that kind are skipped for the remaining texts too, and scanning ends when every kind is found.
    The result then holds at most one finding per kind, in the order they were found.

    With first_only=False every finding is returned, text by text and by start offset within a
    text; a finding inside a longer one of the same kind is dropped ("+1 (202) 555-0143" is one
    phone, not also "(202) 555-0143"). Offsets are relative to the original text a finding came
    from (normalisation is undone), so a span may contain the zero-width characters it hid.
    """
    findings: list[Finding] = []
    if not first_only:
        for text in texts:
            norm = normalise(text)
            found = sorted(
                (norm.restore(f) for d in detectors for f in d.find(norm.text)),
                key=lambda f: (f.start, -f.end),
            )
            reach: dict[str, int] = {}  # per kind, the furthest end so far; everything before starts earlier
            for f in found:
                if f.end > reach.get(f.kind, -1):
                    findings.append(f)
                    reach[f.kind] = f.end
        return findings

    pending = {d.kind for d in detectors}
    for text in texts:
        if not pending:
            break
        norm = normalise(text)
        for detector in detectors:
            if detector.kind not in pending:
                continue
            find_first = getattr(detector, "find_first", None)
            if find_first is not None:
                finding = find_first(norm.text)
            else:
                found = detector.find(norm.text)
                finding = found[0] if found else None
            if finding is not None:
                findings.append(norm.restore(finding))
                pending.discard(detector.kind)
    return findings
