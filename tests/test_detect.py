"""Data-class detection: real positives of every kind are found, ordinary numbers are not.

Fake secrets are assembled at run time ("ghp_" + ...) so that secret scanners do not flag this
file; they have the real shapes all the same.
"""

from __future__ import annotations

import re

import pytest

from policies.detect import (
    BUILTIN_KINDS,
    Finding,
    RegexDetector,
    builtin_detectors,
    decoded_views,
    iban_valid,
    luhn_valid,
    normalise,
    scan,
)

ALL = builtin_detectors()


def find_all(text: str) -> list[Finding]:
    return scan([text], ALL, first_only=False)


# (kind, text, the exact span expected to be reported)
POSITIVES = [
    # email
    ("email", "write to jane.doe@example.com.", "jane.doe@example.com"),
    ("email", "mailto:john+tag@mail.example.org?subject=hi", "john+tag@mail.example.org"),
    ("email", "cc: a_b-c%d@sub.domain.co.uk, thanks", "a_b-c%d@sub.domain.co.uk"),
    ("email", "<ops@polyroute.io>", "ops@polyroute.io"),
    # phone
    ("phone", "call +33 6 12 34 56 78 today", "+33 6 12 34 56 78"),
    ("phone", "US office: +1-202-555-0143.", "+1-202-555-0143"),
    ("phone", "tel:+442071838750", "+442071838750"),
    ("phone", "London +44 (0)20 7183 8750", "+44 (0)20 7183 8750"),
    ("phone", "ring (202) 555-0143 after 5", "(202) 555-0143"),
    ("phone", "ring 202-555-0143 after 5", "202-555-0143"),
    ("phone", "ring 202.555.0143 after 5", "202.555.0143"),
    ("phone", "toll free 1-800-555-0199", "800-555-0199"),
    ("phone", "Tél : 06 12 34 56 78", "06 12 34 56 78"),
    ("phone", "portable 06.12.34.56.78.", "06.12.34.56.78"),
    ("phone", "fixe 01-44-55-66-77", "01-44-55-66-77"),
    # iban
    ("iban", "IBAN: DE89 3704 0044 0532 0130 00", "DE89 3704 0044 0532 0130 00"),
    ("iban", "pay GB82 WEST 1234 5698 7654 32 today", "GB82 WEST 1234 5698 7654 32"),
    ("iban", "RIB FR14 2004 1010 0505 0001 3M02 606.", "FR14 2004 1010 0505 0001 3M02 606"),
    ("iban", "compact DE89370400440532013000", "DE89370400440532013000"),
    ("iban", "NL91ABNA0417164300", "NL91ABNA0417164300"),
    ("iban", "CH9300762011623852957", "CH9300762011623852957"),
    # a group-sized word after the IBAN is not swallowed into it
    ("iban", "virement BE68 5390 0754 7034 EUR", "BE68 5390 0754 7034"),
    # credit_card
    ("credit_card", "card 4111 1111 1111 1111 exp 12/26", "4111 1111 1111 1111"),
    ("credit_card", "card 4111-1111-1111-1111", "4111-1111-1111-1111"),
    ("credit_card", "mc 5500-0000-0000-0004", "5500-0000-0000-0004"),
    ("credit_card", "mc 5555555555554444", "5555555555554444"),
    ("credit_card", "mc 2-series 2223003122003222", "2223003122003222"),
    ("credit_card", "amex 378282246310005", "378282246310005"),
    ("credit_card", "amex 3782 822463 10005", "3782 822463 10005"),
    ("credit_card", "discover 6011111111111117", "6011111111111117"),
    ("credit_card", "jcb 3530111333300000", "3530111333300000"),
    ("credit_card", "old visa 4222222222222", "4222222222222"),
    # national_id
    ("national_id", "SSN 123-45-6789.", "123-45-6789"),
    ("national_id", "ssn: 078-05-1120", "078-05-1120"),
    ("national_id", "NI number QQ 12 34 56 C", "QQ 12 34 56 C"),
    ("national_id", "NINO AB123456C", "AB123456C"),
    ("national_id", "NINO JG 103749 D", "JG 103749 D"),
    ("national_id", "NIR 1 85 05 78 006 084 91", "1 85 05 78 006 084 91"),
    ("national_id", "NIR 185057800608491", "185057800608491"),
    ("national_id", "Corse-du-Sud 2 90 03 2A 004 123 20", "2 90 03 2A 004 123 20"),
    ("national_id", "Haute-Corse 2900318004123 47", "2900318004123 47"),
    ("national_id", "Guadeloupe 1 70 01 971 01 234 62", "1 70 01 971 01 234 62"),
    # api_secret
    ("api_secret", "OPENAI_API_KEY=sk-" + "aB3d" * 12, "sk-" + "aB3d" * 12),
    ("api_secret", 'key = "sk-proj-' + "Xy9_z-Q8" * 8 + '"', "sk-proj-" + "Xy9_z-Q8" * 8),
    ("api_secret", "aws_access_key_id = AKIA" + "IOSFODNN7EXAMPLE", "AKIA" + "IOSFODNN7EXAMPLE"),
    ("api_secret", "token ghp_" + "a1B2c3" * 6, "ghp_" + "a1B2c3" * 6),
    ("api_secret", "oauth gho_" + "Z9y8X7" * 6 + " end", "gho_" + "Z9y8X7" * 6),
    ("api_secret", "app ghs_" + "0aB1cD" * 6, "ghs_" + "0aB1cD" * 6),
    ("api_secret", "pat github_pat_" + "11AB2C_x9Y" * 6, "github_pat_" + "11AB2C_x9Y" * 6),
    (
        "api_secret",
        "SLACK=xoxb-" + "123456789012-1234567890123-AbCdEf",
        "xoxb-" + "123456789012-1234567890123-AbCdEf",
    ),
    (
        "api_secret",
        "maps key=AIza" + "SyA1234567890abcdefghijklmnopqrstuv",
        "AIza" + "SyA1234567890abcdefghijklmnopqrstuv",
    ),
    ("api_secret", "-----BEGIN RSA PRIVATE " + "KEY-----\nMIIE", "-----BEGIN RSA PRIVATE " + "KEY-----"),
    (
        "api_secret",
        "-----BEGIN OPENSSH PRIVATE " + "KEY-----\nb3Bl\n-----END OPENSSH PRIVATE " + "KEY-----\nrest",
        "-----BEGIN OPENSSH PRIVATE " + "KEY-----\nb3Bl\n-----END OPENSSH PRIVATE " + "KEY-----",
    ),
    ("api_secret", "-----BEGIN PRIVATE " + "KEY-----", "-----BEGIN PRIVATE " + "KEY-----"),
    (
        "api_secret",
        "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln",
        "Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln",
    ),
    ("api_secret", "authorization: bearer " + "0123456789abcdef" * 2, "bearer " + "0123456789abcdef" * 2),
]


@pytest.mark.parametrize(("kind", "text", "span"), POSITIVES, ids=[f"{k}:{s[:24]}" for k, _, s in POSITIVES])
def test_positive(kind, text, span):
    findings = find_all(text)
    assert [(f.kind, text[f.start : f.end]) for f in findings] == [(kind, span)]


NEGATIVES = [
    # dates and times
    "released 2024-01-15",
    "released 15/01/2024 and 1/2/2024",
    "released 01.02.2024",
    "released Jan 15, 2024",
    "build 20241115",
    "at 12:30:45 or 09:15 or 23:59:59.999",
    "in 1999, 2025 and 2030",
    "2024-01-15T12:30:45Z",
    # prices and percentages
    "costs $1,299.99",
    "costs € 45,00",
    "costs 1.299,99 EUR or 45.00 USD",
    "1,000,000 units and 12,345,678.90",
    "growth 12.5% and 99.9 % uptime, -3.2%",
    # versions
    "version 1.2.3",
    "v2.10.3, 3.11.7, 2.0.0-rc.1",
    "Windows 10.0.19045.3803",
    "1.2.3.4.5",
    # order numbers, invoices, tickets
    "Order #123456789",
    "order 1234567890 shipped",
    "invoice INV-2024-00123",
    "invoice 2024/000123",
    "ticket 20231115-0042",
    # postal codes, ISBNs, coordinates, addresses
    "ZIP 75008 or 90210-1234",
    "SW1A 1AA London",
    "ISBN 978-3-16-148410-0",
    "ISBN 978-0-306-40615-7 or 0-306-40615-2",
    "ISBN 9780306406157",
    "at 48.8566, 2.3522",
    "at 40.7128, -74.0060",
    # phone-like digits without separators or +
    "call extension 12345",
    "dial 1234567890",
    "dial 0612345678",
    "local 555-0143",
    "123-456-7890",  # area code and exchange cannot start with 1 or 0
    "x +10 20 30 40",
    "+5 points, +1.5, +12.5%, +/- 3",
    "x +1.234567e10",
    # cards
    "16 digits 4111111111111112",  # fails Luhn
    "order id 4000123412341235",  # fails Luhn
    "ref 1234567812345670",  # passes Luhn, no issuer starts with 1
    "1234 5678 9012 3456",
    "timestamp 1700000000000",
    # IBANs
    "IBAN DE88 3704 0044 0532 0130 00",  # wrong check digits
    "IBAN GB00 WEST 1234 5698 7654 32",
    "ref AB12CDEFGHIJKLMNOP",
    # national ids
    "SSN 000-12-3456",
    "SSN 666-12-3456 or 912-34-5678",
    "SSN 123-00-4567 or 123-45-0000",
    "NIR 1 85 05 78 006 084 36",  # wrong key (91 is right)
    "NIR 185051378006084",  # NIR-shaped, wrong key
    "code DA123456A",  # D is never a first NINO letter
    "code GB123456A",  # unallocated NINO prefix
    # secrets
    "use the sk- prefix for keys",
    "sk-learn-is-a-python-library-for-ml",
    "task-force-members-and-volunteers",
    "Authorization: Bearer $POLYROUTE_API_KEY",
    "Bearer tokens are described in RFC 6750",
    "-----BEGIN PUBLIC KEY-----",
    "-----BEGIN CERTIFICATE-----",
    "AKIA is the prefix of AWS key ids",
    # @ in prose and code
    "meet @ noon",
    "@decorator and @user",
    "user@localhost",
    "icon@2x.png",
    # misc
    "IP 192.168.1.254 and 10.0.0.1",
    "MAC 00:1B:44:11:3A:B7",
    "uuid 550e8400-e29b-41d4-a716-446655440000",
    "sha a3f5c9e1b2d4 and 0x7fffffff",
    "pi 3.14159265358979 and 2^31-1 = 2147483647",
    "ratio 1:2:3, score 3-1, pages 12-34",
    "",
]


@pytest.mark.parametrize("text", NEGATIVES)
def test_negative(text):
    assert find_all(text) == []


def test_negatives_together_in_one_prompt():
    """The negatives glued into one text still yield nothing (guards hold across neighbours)."""
    assert find_all("\n".join(NEGATIVES)) == []
    assert find_all(" ".join(NEGATIVES)) == []


@pytest.mark.parametrize(
    ("digits", "valid"),
    [
        ("4111111111111111", True),
        ("79927398713", True),
        ("0000000000000000", True),
        ("4111111111111112", False),
        ("1234567812345678", False),
        ("", False),
        ("0", False),
        ("4111 1111 1111 1111", False),  # digits only
        ("４１１１１１１１１１１１１１１１", False),  # full-width digits are not ASCII digits
    ],
)
def test_luhn_valid(digits, valid):
    assert luhn_valid(digits) is valid


@pytest.mark.parametrize(
    ("candidate", "valid"),
    [
        ("DE89 3704 0044 0532 0130 00", True),
        ("DE89370400440532013000", True),
        ("de89 3704 0044 0532 0130 00", True),
        ("GB82 WEST 1234 5698 7654 32", True),
        ("FR14 2004 1010 0505 0001 3M02 606", True),
        ("NO9386011117947", True),
        ("DE88 3704 0044 0532 0130 00", False),  # check digits
        ("DE89 3704 0044 0532 0130 0", False),  # one character short for DE
        ("FR14 2004 1010 0505 0001 3M02 6061", False),  # one too many for FR
        ("DE89-3704-0044-0532-0130-00", False),
        ("", False),
    ],
)
def test_iban_valid(candidate, valid):
    assert iban_valid(candidate) is valid


def test_first_only_reports_each_kind_once_across_texts():
    texts = ["a@example.com and b@example.com", "call 202-555-0143", "c@example.com"]
    findings = scan(texts, ALL)
    assert [f.kind for f in findings] == ["email", "phone"]
    assert (findings[0].start, findings[0].end) == (0, len("a@example.com"))


def test_first_only_false_reports_everything_in_text_order():
    text = "b@example.com, 202-555-0143, a@example.com"
    findings = scan([text], ALL, first_only=False)
    assert [(f.kind, text[f.start : f.end]) for f in findings] == [
        ("email", "b@example.com"),
        ("phone", "202-555-0143"),
        ("email", "a@example.com"),
    ]


def test_first_only_false_drops_same_kind_findings_inside_a_longer_one():
    # The international pattern sees "+1 (202) 555-0143", the North American one "(202) 555-0143".
    assert [f.kind for f in scan(["+1 (202) 555-0143"], ALL, first_only=False)] == ["phone"]


class CountingDetector:
    """A detector without find_first, counting the texts it is given."""

    def __init__(self, kind: str, needle: str) -> None:
        self.kind, self.needle, self.calls = kind, needle, 0

    def find(self, text: str) -> list[Finding]:
        self.calls += 1
        return [Finding(self.kind, m.start(), m.end()) for m in re.finditer(re.escape(self.needle), text)]


def test_first_only_skips_found_kinds_and_stops_when_all_found():
    x, y = CountingDetector("x", "X"), CountingDetector("y", "Y")
    findings = scan(["X", "X Y", "X Y", "X Y"], [x, y])
    assert [(f.kind, f.start) for f in findings] == [("x", 0), ("y", 2)]
    assert x.calls == 1  # found in the first text, never asked again
    assert y.calls == 2  # found in the second text; the last two texts are not scanned at all


def test_first_only_skips_other_detectors_of_a_found_kind():
    first, second = CountingDetector("k", "A"), CountingDetector("k", "B")
    assert [f.start for f in scan(["A B"], [first, second])] == [0]
    assert second.calls == 0


def test_builtin_detectors_all_and_selected():
    assert {d.kind for d in builtin_detectors()} == set(BUILTIN_KINDS)
    assert {d.kind for d in builtin_detectors(["email", "iban"])} == {"email", "iban"}
    assert {d.kind for d in builtin_detectors("phone")} == {"phone"}
    assert builtin_detectors([]) == []
    assert len(builtin_detectors(["email", "email"])) == len(builtin_detectors(["email"]))


def test_builtin_detectors_unknown_kind_is_named():
    with pytest.raises(ValueError, match=r"unknown detector kind\(s\): 'passport';"):
        builtin_detectors(["email", "passport"])


def test_custom_regex_detector():
    plain = RegexDetector("employee_id", r"EMP-\d{6}")
    assert plain.find("ids EMP-123456 and EMP-12345") == [Finding("employee_id", 4, 14)]
    even_only = RegexDetector(
        "employee_id", re.compile(r"EMP-(\d{6})"), validator=lambda s: int(s[-1]) % 2 == 0
    )
    text = "EMP-123457 EMP-123458"
    assert [text[f.start : f.end] for f in even_only.find(text)] == ["EMP-123458"]
    assert scan([text], [even_only, *builtin_detectors(["email"])]) == [Finding("employee_id", 11, 21)]


def test_unicode_around_a_finding():
    text = "Écrivez à élodie.martin@exemple.fr — merci 😊 ou appelez le 06 12 34 56 78 ✓"
    found = {f.kind: text[f.start : f.end] for f in find_all(text)}
    assert found == {"email": "élodie.martin@exemple.fr", "phone": "06 12 34 56 78"}


def test_digits_glued_to_letters_or_longer_runs_do_not_match_in_part():
    for text in [
        "x123-45-6789",
        "123-45-67890",
        "9202-555-0143",
        "4111111111111111111111",
        "é06 12 34 56 78",
    ]:
        assert find_all(text) == [], text


def test_empty_input():
    assert scan([], ALL) == []
    assert scan([""], ALL) == []
    assert scan(["", ""], ALL, first_only=False) == []
    assert scan(["a@example.com"], []) == []


# ---- evasion: the same data written so that a naive pattern misses it (issue 12) -------------
ZW = "\u200b"  # zero-width space
FW = str.maketrans("0123456789@+", "０１２３４５６７８９＠＋")  # full-width digits, @ and +
AR = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")  # Arabic-Indic digits

EVASIONS = [
    # credit_card: dots, mixed and spaced separators, other scripts' digits, invisible characters
    ("credit_card", "card 4111.1111.1111.1111 exp", "4111.1111.1111.1111"),
    ("credit_card", "card 4111 1111-1111.1111 exp", "4111 1111-1111.1111"),
    ("credit_card", "card 4111 - 1111 - 1111 - 1111", "4111 - 1111 - 1111 - 1111"),
    ("credit_card", "card 4111\u20131111\u20131111\u20131111", "4111\u20131111\u20131111\u20131111"),
    ("credit_card", "card 4111\u00a01111\u00a01111\u00a01111", "4111\u00a01111\u00a01111\u00a01111"),
    ("credit_card", "card " + "4111 1111 1111 1111".translate(FW), "4111 1111 1111 1111".translate(FW)),
    ("credit_card", "card " + "5555555555554444".translate(AR), "5555555555554444".translate(AR)),
    (
        "credit_card",
        "card 4" + ZW + "111 11" + ZW + "11 1111 1111",
        "4" + ZW + "111 11" + ZW + "11 1111 1111",
    ),
    ("credit_card", "card " + ZW.join("4111111111111111"), ZW.join("4111111111111111")),
    ("credit_card", "card 3782\u2009822463\u200910005", "3782\u2009822463\u200910005"),
    ("credit_card", "exp 12/26 4111 1111 1111 1111", "4111 1111 1111 1111"),
    ("credit_card", "0 4111 1111 1111 1111", "4111 1111 1111 1111"),
    ("credit_card", "4111 1111 1111 1111 12", "4111 1111 1111 1111"),
    # email: invisible characters, full-width @, look-alike letters in the domain
    ("email", "mail ja" + ZW + "ne@exa" + ZW + "mple.com now", "ja" + ZW + "ne@exa" + ZW + "mple.com"),
    ("email", "mail jane\u00ad.doe@example.com", "jane\u00ad.doe@example.com"),
    ("email", "mail jane＠example.com", "jane＠example.com"),
    ("email", "mail jane@ex\u0430mple.com", "jane@ex\u0430mple.com"),  # Cyrillic a
    # iban: lower case, dashes, dots, no separators
    ("iban", "iban de89 3704 0044 0532 0130 00", "de89 3704 0044 0532 0130 00"),
    ("iban", "iban DE89-3704-0044-0532-0130-00", "DE89-3704-0044-0532-0130-00"),
    ("iban", "iban de89370400440532013000", "de89370400440532013000"),
    ("iban", "iban gb82.west.1234.5698.7654.32", "gb82.west.1234.5698.7654.32"),
    ("iban", "iban FR14" + ZW + "2004 1010 0505 0001 3M02 606", "FR14" + ZW + "2004 1010 0505 0001 3M02 606"),
    # national_id: an SSN without dashes next to a word naming it; a lower-case NINO
    ("national_id", "SSN 123456789", "123456789"),
    ("national_id", "social security number: 123 45 6789.", "123 45 6789"),
    ("national_id", '{"ssn": "078.05.1120"}', "078.05.1120"),
    ("national_id", "user_ssn=078051120", "078051120"),
    ("national_id", "SSN " + "078-05-1120".translate(FW), "078-05-1120".translate(FW)),
    ("national_id", "nino ab123456c", "ab123456c"),
    # phone: national formats, mixed separators, full-width
    ("phone", "portable 06.12 34-56 78", "06.12 34-56 78"),
    ("phone", "mobile 07700 900123", "07700 900123"),
    ("phone", "London 020 7183 8750", "020 7183 8750"),
    ("phone", "Manchester 0161 496 0000", "0161 496 0000"),
    ("phone", "Berlin 030 1234567", "030 1234567"),
    ("phone", "Berlin 030/12345678", "030/12345678"),
    ("phone", "Berlin (030) 1234567", "(030) 1234567"),
    ("phone", "Berlin +49 30 1234567", "+49 30 1234567"),
    ("phone", "call (555) 123-4567", "(555) 123-4567"),
    ("phone", "call 202 555-0143", "202 555-0143"),
    ("phone", "call " + "+33 6 12 34 56 78".translate(FW), "+33 6 12 34 56 78".translate(FW)),
    ("phone", "call 0" + ZW + "6 12 3" + ZW + "4 56 78", "0" + ZW + "6 12 3" + ZW + "4 56 78"),
    # api_secret: Stripe, AWS secret key, JWT, GitLab
    ("api_secret", "STRIPE=sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc", "sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc"),
    ("api_secret", "key rk_live_" + "51H8kLmN0pQ2rS4tU6vW8xY0", "rk_live_" + "51H8kLmN0pQ2rS4tU6vW8xY0"),
    (
        "api_secret",
        "aws_secret_access_key = " + "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYEXAMPLEKEY",
        "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYEXAMPLEKEY",
    ),
    (
        "api_secret",
        '"SecretAccessKey": "' + "je7MtGbClwBF/2Zp9Utk/" + 'h3yCo8nvbEXAMPLEKEY"',
        "je7MtGbClwBF/2Zp9Utk/" + "h3yCo8nvbEXAMPLEKEY",
    ),
    (
        "api_secret",
        "token=eyJ"
        + "hbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFU",
        "eyJ"
        + "hbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFU",
    ),
    ("api_secret", "GITLAB=glpat-" + "xK9mP2qR7sT4uV6wY8zA", "glpat-" + "xK9mP2qR7sT4uV6wY8zA"),
    ("api_secret", "key sk-" + ZW.join("aB3d" * 12), "sk-" + ZW.join("aB3d" * 12)),
]


@pytest.mark.parametrize(("kind", "text", "span"), EVASIONS, ids=[f"{k}:{t[-24:]!a}" for k, t, _ in EVASIONS])
def test_evasion_is_detected_with_its_original_span(kind, text, span):
    findings = [f for f in find_all(text) if f.kind == kind]
    assert [text[f.start : f.end] for f in findings] == [span]


TECHNICAL_NEGATIVES = [
    "866.266 6679 and 404.315 4507",  # a decimal then a number is no phone
    "values 12 34 56 78 90 12 34 56 78 90 11 22",  # a table of pairs holds every phone shape
    "01 02 03 04 05 06 07 08 09 10",
    "0123 4567 8901 2345 6789",
    "2019 2020 2021 2022 2023 2024 2025",
    "ports 8080 8443 9090 3000 5432 6379 27017",
    "measured 0.123 0.456 0.789 1.234 5.678 9.012 ms",
    "at 48.85661 2.35222 then 40.71278 -74.00597",
    "ISO 8601: 2024-11-15T12:30:45.123456789Z",
    "sha1 da39a3ee5e6b4b0d3255bfef95601890afd80709 in the aws bucket",
    "the secret digest is 2fd4e1c67a2d28fced849ee1bb76e7391b93eb12",
    "AWS region us-east-1 holds bucket my-bucket-2024 since 2021",
    "classname 123456789",  # "ssn" inside a word is no context
    "the laws of 1999 and ticket 123456789",
    "order 123456789 shipped on 2024-11-15",
    "eyJ is how base64-encoded JSON starts",
    "(2024) 15 papers and (0) 12 34",
    "ab12 cdef ghij klmn and de12 have been seen",
    "build 4.1.1.1 and 1111.2222.3333",
    "SKU 4011-2233-44 and lot 55-66-7788",
    "timestamps 1700000000000 1700000000123 1700000000456",
    "uuids 123e4567-e89b-12d3-a456-426614174000",
    "matrix [[0.1, 0.2], [0.3, 0.4]] and 1e-10, 6.022e23",
    "version 10.0.19045.3803 build 22621.2428",
]


@pytest.mark.parametrize("text", TECHNICAL_NEGATIVES)
def test_technical_text_is_not_personal_data(text):
    assert find_all(text) == []


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii stays the same object",
        "tab\tand\nnewline",
        "é, 😊 and 中文 read as themselves",
    ],
)
def test_normalise_leaves_ordinary_text_alone(text):
    norm = normalise(text)
    assert norm.text is text and norm.original(3) == 3


def test_normalise_folds_and_maps_offsets_back():
    text = "a\u200bb ４\ufb01 x\u2013y\u00a0z\x00!"
    norm = normalise(text)
    assert norm.text == "ab 4fi x-y z!"
    for i, ch in enumerate(norm.text):
        assert normalise(text[norm.original(i)]).text.startswith(ch) or ch in "fi"
    assert normalise(norm.text).text == norm.text  # idempotent


@pytest.mark.parametrize(
    ("text", "view"),
    [
        ('{"q": "ja\\u200bne@example.com"}', '{"q": "ja\u200bne@example.com"}'),
        ("https://x.example/?to=jane%40example.com", "https://x.example/?to=jane@example.com"),
        ("mail jane&#64;example.com or &#x6a;ohn@example.org", "mail jane@example.com or john@example.org"),
    ],
)
def test_decoded_views_undo_escapes(text, view):
    assert view in decoded_views(text)
    assert [f.kind for f in scan([view], ALL)] == ["email"]


def test_decoded_views_leave_plain_text_alone():
    assert decoded_views("growth 12% in Q3, see C:\\users and &amp; more") == []
