"""The labelled corpus for data-class detection: obfuscated PII and secrets, and technical prose.

Synthetic only: every card number, IBAN, SSN, NIR or key below is generated (valid check digits,
random otherwise) and belongs to no one. Seeded, so the file is the same on every run:

    .venv/bin/python bench/pii_corpus.py            # writes bench/data/pii_corpus.jsonl

Each line: {"kind": detector kind or null, "variant": how it is written, "text": ...}. A null kind
is a negative (ordinary technical text that holds no personal data). Lines of kind api_secret are
stored ROT13-encoded ("rot13": true): they have real key shapes, and a repository secret scanner
would otherwise flag them. `load()` decodes them.

The positives are what an evasive client would try (issue 12): every separator (space, dot, dash,
mixed, spaced, no-break and thin spaces, en dashes), other scripts' digits (full-width,
Arabic-Indic, Devanagari), zero-width and soft-hyphen characters inside, lower case, national
phone formats, and the usual key formats, each inside a sentence.
"""

from __future__ import annotations

import codecs
import json
import random
import string
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CORPUS = ROOT / "data" / "pii_corpus.jsonl"
SEED = 12
PER_VARIANT = 12  # positives per (kind, variant)
NEGATIVES = 1500

ZERO_WIDTH = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad"]
DIGIT_SCRIPTS = {
    "fullwidth": "０１２３４５６７８９",
    "arabic_indic": "٠١٢٣٤٥٦٧٨٩",
    "devanagari": "०१२३४५६७८९",
}


def in_script(text: str, script: str) -> str:
    return text.translate(str.maketrans("0123456789", DIGIT_SCRIPTS[script]))


def sprinkle(rng: random.Random, text: str, every: int = 3) -> str:
    """Invisible characters inside the value, between characters that are not separators."""
    out = []
    for i, ch in enumerate(text):
        out.append(ch)
        if i < len(text) - 1 and ch.isalnum() and text[i + 1].isalnum() and rng.randrange(every) == 0:
            out.append(rng.choice(ZERO_WIDTH))
    return "".join(out)


def group(digits: str, sizes: list[int], seps: list[str]) -> str:
    parts, at = [], 0
    for size in sizes:
        parts.append(digits[at : at + size])
        at += size
    if at < len(digits):
        parts.append(digits[at:])
    out = parts[0]
    for i, part in enumerate(parts[1:]):
        out += seps[i % len(seps)] + part
    return out


def rdigits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(n))


# --- values with valid check digits ---------------------------------------------------------------


def luhn_complete(partial: str) -> str:
    total = 0
    for i, ch in enumerate(reversed(partial)):
        d = int(ch)
        if i % 2 == 0:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return partial + str((10 - total % 10) % 10)


CARD_ISSUERS = [("4", 16), ("4", 13), ("4", 19), ("51", 16), ("55", 16), ("2221", 16), ("2720", 16),
                ("34", 15), ("37", 15), ("6011", 16), ("65", 16), ("35", 16)]  # fmt: skip


def card(rng: random.Random) -> str:
    prefix, length = rng.choice(CARD_ISSUERS)
    return luhn_complete(prefix + rdigits(rng, length - len(prefix) - 1))


IBAN_FORMATS = {  # country: BBAN as (letters, digits) runs
    "DE": [("d", 18)],
    "FR": [("d", 23)],
    "GB": [("a", 4), ("d", 14)],
    "NL": [("a", 4), ("d", 10)],
    "ES": [("d", 20)],
    "IT": [("a", 1), ("d", 22)],
    "BE": [("d", 12)],
    "CH": [("d", 17)],
    "NO": [("d", 11)],
    "AT": [("d", 16)],
}


def iban(rng: random.Random) -> str:
    country = rng.choice(sorted(IBAN_FORMATS))
    bban = "".join(
        "".join(rng.choice(string.ascii_uppercase if k == "a" else string.digits) for _ in range(n))
        for k, n in IBAN_FORMATS[country]
    )
    numeric = "".join(str(int(c, 36)) for c in bban + country + "00")
    check = 98 - int(numeric) % 97
    return f"{country}{check:02d}{bban}"


def ssn(rng: random.Random) -> str:
    while True:
        area = rng.randrange(1, 900)
        if area != 666:
            return f"{area:03d}{rng.randrange(1, 100):02d}{rng.randrange(1, 10000):04d}"


def nir(rng: random.Random) -> str:
    body = f"{rng.choice('12')}{rng.randrange(100):02d}{rng.randrange(1, 13):02d}{rng.randrange(1, 96):02d}"
    body += f"{rng.randrange(1, 1000):03d}{rng.randrange(1, 1000):03d}"
    return body + f"{97 - int(body) % 97:02d}"


def nino(rng: random.Random) -> str:
    first = rng.choice("ABCEGHJKLMNPRSTWXYZ")
    second = rng.choice("ABCEGHJKLMNPRSTWXYZ")
    while first + second in {"BG", "GB", "KN", "NK", "NT", "TN", "ZZ"}:
        second = rng.choice("ABCEGHJKLMNPRSTWXYZ")
    return first + second + rdigits(rng, 6) + rng.choice("ABCD")


# --- positives ------------------------------------------------------------------------------------
Variant = Callable[[random.Random], str]

SENTENCES = {
    "email": [
        "Please send the report to {} before Friday.",
        "Contact: {}",
        "cc {} on the thread",
        "Reply to <{}>.",
    ],
    "credit_card": [
        "Charge the card {} for the renewal.",
        "card number: {}",
        "Payment with {} failed.",
        "{} exp 11/27",
    ],
    "iban": ["Wire the refund to {} please.", "IBAN: {}", "account {} (main)", "Pay to {} by Monday."],
    "national_id": ["{}", "The applicant gave {} on the form.", "record: {}", "Verify {} against the file."],
    "phone": ["Call me at {} tomorrow.", "tel: {}", "Reach the office on {}.", "mobile {} (after 6pm)"],
    "api_secret": ["export KEY={}", 'config = {{"token": "{}"}}', "use {} for the staging account", "{}"],
}

NAMES = [
    "jane.doe",
    "j.smith",
    "marie-claire",
    "o.connor",
    "li.wei",
    "ahmed+billing",
    "sam_99",
    "élodie.martin",
]
DOMAINS = [
    "example.com",
    "mail.example.org",
    "exemple.fr",
    "corp.example.co.uk",
    "uni-example.de",
    "example.io",
]


def email_variants() -> dict[str, Variant]:
    def base(rng: random.Random) -> str:
        return f"{rng.choice(NAMES)}@{rng.choice(DOMAINS)}"

    return {
        "plain": base,
        "upper": lambda rng: base(rng).upper(),
        "zero_width": lambda rng: sprinkle(rng, base(rng), 2),
        "fullwidth_at": lambda rng: base(rng).replace("@", "＠"),
        "fullwidth_letters": lambda rng: base(rng).translate(
            str.maketrans(string.ascii_lowercase, "".join(chr(0xFF41 + i) for i in range(26)))
        ),
        "homoglyph_domain": lambda rng: base(rng).replace("example", "ex\u0430mple"),
        "small_at": lambda rng: base(rng).replace("@", "\ufe6b"),
    }


SEPARATORS = {
    "space": [" "],
    "dot": ["."],
    "dash": ["-"],
    "mixed": [" ", "-", "."],
    "spaced_dash": [" - "],
    "nbsp": ["\u00a0"],
    "thin_space": ["\u2009"],
    "en_dash": ["\u2013"],
}


def card_variants() -> dict[str, Variant]:
    def grouped(seps: list[str]) -> Variant:
        def make(rng: random.Random) -> str:
            number = card(rng)
            sizes = [4, 6, 5] if len(number) == 15 else [4, 4, 4, 4]
            return group(number, sizes, seps)

        return make

    variants: dict[str, Variant] = {"run": card}
    variants.update({f"sep_{name}": grouped(seps) for name, seps in SEPARATORS.items()})
    for script in DIGIT_SCRIPTS:
        variants[f"digits_{script}"] = lambda rng, s=script: in_script(grouped([" "])(rng), s)
    variants["zero_width"] = lambda rng: sprinkle(rng, grouped([" "])(rng))
    variants["zero_width_run"] = lambda rng: sprinkle(rng, card(rng), 1)
    variants["after_other_group"] = lambda rng: (
        f"{rng.randrange(1, 13):02d}/{rng.randrange(25, 31)} " + grouped([" "])(rng)
    )
    return variants


def iban_variants() -> dict[str, Variant]:
    def spaced(rng: random.Random, sep: str = " ") -> str:
        value = iban(rng)
        return sep.join(value[i : i + 4] for i in range(0, len(value), 4))

    return {
        "compact": iban,
        "spaced": spaced,
        "lower_spaced": lambda rng: spaced(rng).lower(),
        "lower_compact": lambda rng: iban(rng).lower(),
        "dashed": lambda rng: spaced(rng, "-"),
        "dotted": lambda rng: spaced(rng, "."),
        "lower_dashed": lambda rng: spaced(rng, "-").lower(),
        "zero_width": lambda rng: sprinkle(rng, spaced(rng)),
        "fullwidth_digits": lambda rng: in_script(spaced(rng), "fullwidth"),
        "nbsp": lambda rng: spaced(rng, "\u00a0"),
    }


SSN_CONTEXT = ["SSN {}", "ssn: {}", "Social Security number {}", "social security no. {}", '"ssn": "{}"',
               "SSN#{}", "user_ssn={}", "Soc. Sec. {}"]  # fmt: skip


def national_id_variants() -> dict[str, Variant]:
    def ssn_with(sep: str, context: bool) -> Variant:
        def make(rng: random.Random) -> str:
            value = ssn(rng)
            text = f"{value[:3]}{sep}{value[3:5]}{sep}{value[5:]}"
            return rng.choice(SSN_CONTEXT).format(text) if context else text

        return make

    return {
        "ssn_dashed": ssn_with("-", False),
        "ssn_en_dash": ssn_with("\u2013", False),
        "ssn_fullwidth": lambda rng: in_script(ssn_with("-", False)(rng), "fullwidth"),
        "ssn_zero_width": lambda rng: sprinkle(rng, ssn_with("-", False)(rng)),
        "ssn_undashed_context": ssn_with("", True),
        "ssn_spaced_context": ssn_with(" ", True),
        "ssn_dotted_context": ssn_with(".", True),
        "nir_spaced": lambda rng: group(nir(rng), [1, 2, 2, 2, 3, 3], [" "]),
        "nir_compact": nir,
        "nino_spaced": lambda rng: (lambda v: f"{v[:2]} {v[2:4]} {v[4:6]} {v[6:8]} {v[8]}")(nino(rng)),
        "nino_compact": nino,
        "nino_lower": lambda rng: nino(rng).lower(),
    }


def phone_variants() -> dict[str, Variant]:
    def fr(rng: random.Random, seps: list[str]) -> str:
        return group("0" + rng.choice("1234567") + rdigits(rng, 8), [2, 2, 2, 2], seps)

    def nanp(rng: random.Random) -> tuple[str, str, str]:
        return (
            f"{rng.randrange(2, 10)}{rdigits(rng, 2)}",
            f"{rng.randrange(2, 10)}{rdigits(rng, 2)}",
            rdigits(rng, 4),
        )

    return {
        "fr_space": lambda rng: fr(rng, [" "]),
        "fr_dot": lambda rng: fr(rng, ["."]),
        "fr_dash": lambda rng: fr(rng, ["-"]),
        "fr_mixed": lambda rng: fr(rng, [" ", ".", "-"]),
        "fr_intl": lambda rng: "+33 " + fr(rng, [" "])[1:],
        "fr_fullwidth": lambda rng: in_script(fr(rng, [" "]), "fullwidth"),
        "fr_zero_width": lambda rng: sprinkle(rng, fr(rng, [" "])),
        "uk_mobile": lambda rng: f"07{rdigits(rng, 3)} {rng.randrange(1, 10)}{rdigits(rng, 5)}",
        "uk_london": lambda rng: f"020 {rng.randrange(3, 9)}{rdigits(rng, 3)} {rdigits(rng, 4)}",
        "uk_city": lambda rng: (
            f"01{rdigits(rng, 2)} {rng.randrange(2, 10)}{rdigits(rng, 2)} {rdigits(rng, 4)}"
        ),
        "uk_intl": lambda rng: f"+44 7{rdigits(rng, 3)} {rdigits(rng, 6)}",
        "de_space": lambda rng: (
            f"0{rng.choice(['30', '89', '221', '40', '711'])} {rng.randrange(1, 10)}{rdigits(rng, 6)}"
        ),
        "de_slash": lambda rng: (
            f"0{rng.choice(['30', '89', '221', '40'])}/{rng.randrange(1, 10)}{rdigits(rng, 6)}"
        ),
        "de_paren": lambda rng: (
            f"(0{rng.choice(['30', '89', '221'])}) {rng.randrange(1, 10)}{rdigits(rng, 6)}"
        ),
        "de_intl": lambda rng: (
            f"+49 {rng.choice(['30', '89', '221'])} {rng.randrange(1, 10)}{rdigits(rng, 6)}"
        ),
        "us_paren": lambda rng: "({}) {}-{}".format(*nanp(rng)),
        "us_paren_555": lambda rng: f"(555) {rdigits(rng, 3)}-{rdigits(rng, 4)}",
        "us_dash": lambda rng: "{}-{}-{}".format(*nanp(rng)),
        "us_dot": lambda rng: "{}.{}.{}".format(*nanp(rng)),
        "us_space_dash": lambda rng: "{} {}-{}".format(*nanp(rng)),
        "us_intl": lambda rng: "+1 {} {} {}".format(*nanp(rng)),
        "us_toll_free": lambda rng: "1-800-{}-{}".format(*nanp(rng)[1:]),
        "us_fullwidth": lambda rng: in_script("({}) {}-{}".format(*nanp(rng)), "fullwidth"),
    }


B64 = string.ascii_letters + string.digits
B64URL = B64 + "-_"


def rtoken(rng: random.Random, n: int, alphabet: str = B64) -> str:
    while True:
        token = "".join(rng.choice(alphabet) for _ in range(n))
        if (
            any(c.isdigit() for c in token)
            and any(c.isupper() for c in token)
            and any(c.islower() for c in token)
        ):
            return token


def jwt(rng: random.Random) -> str:
    import base64

    def seg(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    payload = {"sub": rdigits(rng, 8), "iat": 1700000000 + rng.randrange(10**6)}
    return f"{seg({'alg': 'HS256', 'typ': 'JWT'})}.{seg(payload)}.{rtoken(rng, 43, B64URL)}"


def api_secret_variants() -> dict[str, Variant]:
    aws_context = ["aws_secret_access_key = {}", 'AWS_SECRET_ACCESS_KEY="{}"', '"SecretAccessKey": "{}"',
                   "my aws secret key is {}"]  # fmt: skip
    variants: dict[str, Variant] = {
        "openai": lambda rng: "sk-proj-" + rtoken(rng, 48, B64URL),
        "stripe_live": lambda rng: "sk_live_" + rtoken(rng, 24),
        "stripe_restricted": lambda rng: "rk_live_" + rtoken(rng, 24),
        "aws_key_id": lambda rng: (
            "AKIA" + "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(16))
        ),
        "aws_secret": lambda rng: rng.choice(aws_context).format(rtoken(rng, 40, B64 + "/+")),
        "github": lambda rng: "ghp_" + rtoken(rng, 36),
        "gitlab": lambda rng: "glpat-" + rtoken(rng, 20),
        "slack": lambda rng: f"xoxb-{rdigits(rng, 12)}-{rdigits(rng, 13)}-{rtoken(rng, 24)}",
        "google": lambda rng: "AIza" + rtoken(rng, 35, B64URL),
        "jwt": jwt,
        "bearer": lambda rng: "Authorization: Bearer " + rtoken(rng, 40),
    }
    variants["openai_zero_width"] = lambda rng: sprinkle(rng, variants["openai"](rng))
    variants["stripe_zero_width"] = lambda rng: sprinkle(rng, variants["stripe_live"](rng))
    variants["jwt_zero_width"] = lambda rng: sprinkle(rng, jwt(rng), 8)
    return variants


KINDS: dict[str, Callable[[], dict[str, Variant]]] = {
    "email": email_variants,
    "credit_card": card_variants,
    "iban": iban_variants,
    "national_id": national_id_variants,
    "phone": phone_variants,
    "api_secret": api_secret_variants,
}


def positives(rng: random.Random) -> Iterator[dict]:
    for kind, variants in KINDS.items():
        for variant, make in variants().items():
            for _ in range(PER_VARIANT):
                yield {
                    "kind": kind,
                    "variant": variant,
                    "text": rng.choice(SENTENCES[kind]).format(make(rng)),
                }


# --- negatives: technical prose with every kind of number that is not personal data ---------------


def negative_sentence(rng: random.Random) -> str:
    r = rng.randrange
    hexs = lambda n: "".join(rng.choice("0123456789abcdef") for _ in range(n))  # noqa: E731
    date = f"20{r(15, 27)}-{r(1, 13):02d}-{r(1, 29):02d}"
    choices = [
        f"Upgrade from v{r(1, 5)}.{r(0, 20)}.{r(0, 30)} to {r(1, 5)}.{r(0, 20)}.{r(0, 30)}-rc.{r(1, 5)} before {date}.",
        f"The service listens on {r(1, 256)}.{r(256)}.{r(256)}.{r(1, 255)}:{r(1024, 65536)} and 10.0.{r(256)}.{r(256)}.",
        f"Commit {hexs(40)} fixed the regression introduced in {hexs(7)}.",
        f"Request id {hexs(8)}-{hexs(4)}-4{hexs(3)}-a{hexs(3)}-{hexs(12)} took {r(1, 999)}.{r(1000):03d} ms.",
        f"sha256:{hexs(64)} is the digest of the image tag {r(1, 4)}.{r(0, 12)}.",
        f"Latency p50 {r(1, 99)}.{r(10)} ms, p99 {r(100, 999)}.{r(10)} ms over {r(1000, 99999)} requests.",
        f"Order #{r(10**5, 10**8)} shipped on {date}; invoice INV-{r(2015, 2027)}-{r(1, 99999):05d}.",
        f"Set max_connections = {r(10, 5000)} and shared_buffers = {r(1, 64)}GB on port {r(1024, 65536)}.",
        f'ts={1600000000000 + r(10**11)} level=info msg="flushed {r(1, 9999)} rows in {r(1, 999)}ms"',
        f"The sample weighed {r(1, 999)}.{r(100):02d} g at {r(-40, 60)}.{r(10)} °C and {r(900, 1100)} hPa.",
        f"Coordinates {r(-89, 90)}.{r(10**5):05d}, {r(-179, 180)}.{r(10**5):05d} are within {r(1, 99)} km.",
        f"In {r(1950, 2026)}, {r(2, 99)}% of the {r(100, 99999):,} respondents agreed (n = {r(10, 999)}).",
        f"Use `arr[{r(0, 99)}:{r(100, 999)}]` and call `f({r(0, 99)}, {r(0, 99)}, {r(0, 99)})`.",
        f"Table: {' '.join(str(r(0, 100)) for _ in range(r(6, 20)))}",
        f"Row {r(1, 99)}: {' | '.join(f'{r(0, 10000) / 100:.2f}' for _ in range(r(3, 9)))}",
        f"CVE-{r(2010, 2026)}-{r(1000, 99999)} affects versions {r(1, 9)}.{r(0, 9)}.x through {r(1, 9)}.{r(0, 9)}.{r(0, 99)}.",
        f"ISBN 978-{r(0, 10)}-{r(10, 99)}-{r(100000, 999999)}-{r(10)} and DOI 10.{r(1000, 9999)}/{hexs(6)}.",
        f"Price {r(1, 999)}.{r(100):02d} EUR excl. VAT, SKU {r(1000, 9999)}-{r(100, 999)}-{r(10, 99)}.",
        f"Build {r(10000, 99999)}.{r(1000, 9999)} of Windows {r(7, 12)}.0 ships with kernel {r(4, 7)}.{r(0, 20)}.{r(0, 200)}.",
        f"docker run -p {r(1024, 65536)}:{r(1024, 65536)} -m {r(128, 4096)}m app:{r(1, 9)}.{r(0, 20)}",
        f"Resize the volume from {r(10, 999)} GiB to {r(1000, 9999)} GiB; IOPS {r(3000, 64000)}.",
        f"Matrix [[{r(100) / 10}, {r(100) / 10}], [{r(100) / 10}, {r(100) / 10}]] has determinant {r(-99, 99)}.{r(100)}.",
        f"Run {r(1, 99)} of {r(100, 999)} finished at {r(0, 24):02d}:{r(60):02d}:{r(60):02d}.{r(1000):03d} on {date}.",
        f"Schedule: {date} {r(0, 24):02d}:{r(60):02d}, room {r(100, 999)}, building {r(1, 40)}.",
        f"Serial {r(10**9, 10**10)} of batch {r(1000, 9999)} passed QA with {r(90, 100)}.{r(10)}% yield.",
        f"AWS region us-east-{r(1, 3)} bucket data-{r(2015, 2027)} keeps {r(1, 999)} TB; the secret rotation runs daily.",
        f"MAC {':'.join(hexs(2) for _ in range(6))} got lease {r(1, 255)}.{r(256)}.{r(256)}.{r(256)} for {r(60, 86400)} s.",
        f"Epoch {r(1, 300)}: loss {r(1000) / 1000:.4f}, accuracy {r(5000, 10000) / 100:.2f}, lr {r(1, 9)}e-{r(3, 6)}.",
    ]
    return rng.choice(choices)


def negatives(rng: random.Random) -> Iterator[dict]:
    for _ in range(NEGATIVES):
        text = " ".join(negative_sentence(rng) for _ in range(rng.randrange(1, 4)))
        yield {"kind": None, "variant": "technical", "text": text}


def build() -> list[dict]:
    rng = random.Random(SEED)
    return [*positives(rng), *negatives(rng)]


def load(path: Path = CORPUS) -> list[dict]:
    """The corpus with api_secret lines decoded (see the module docstring)."""
    rows = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line:
            continue
        row = json.loads(line)
        if row.pop("rot13", False):
            row["text"] = codecs.encode(row["text"], "rot13")
        rows.append(row)
    return rows


def main() -> None:
    CORPUS.parent.mkdir(parents=True, exist_ok=True)
    with CORPUS.open("w", encoding="utf-8") as out:
        for row in build():
            if row["kind"] == "api_secret":
                row = {**row, "text": codecs.encode(row["text"], "rot13"), "rot13": True}
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {CORPUS.relative_to(ROOT.parent)}")


if __name__ == "__main__":
    main()
