"""Graders for calibration probes: an answer and its gold → a score in [0, 1], what was read, and why.

One grader per answer type (router/probes), each reading answers the way workers actually write them:

| type   | reads                                                         | score                        |
|--------|---------------------------------------------------------------|------------------------------|
| choice | the committed letter ("C", "(C)", "The answer is C", "**C**", `\\boxed{C}`, "I'd go with C", "C is correct", a closing line "**C) Jupiter**", else "the largest is C) Jupiter"); none for "A or C" or a walk through the options that commits to none | 1 if it is the gold letter |
| number | `\\boxed{..}`, else after "Answer:"/"**Answer**:"/"####"/"answer is", else the last number; fractions, `1\\,234` too, and `1 234` after a marker | 1 if equal within `rel_tol` |
| match  | the answer, SQuAD-normalised (case, punctuation, articles, accents) | 1 if an accepted answer appears in it, else token F1 (`partial: f1`) or 0 |
| code   | the answer's Python (its fenced blocks joined, or the whole answer) | 1 if every test passes, else 0 |

Code runs in router/code_behaviour.py's sandbox: a separate `python -P -s -S -B` interpreter (stdlib
only, no site or user paths, not the current directory) with a clean environment (PATH and
PYTHONHASHSEED only), in a fresh temporary directory, with limits on memory, CPU, open files, file
size and processes (none: no fork, no thread), a timer per statement and a kill of its whole process
group at the timeout. As root it runs as nobody; otherwise this process makes itself non-dumpable, so
that a child of its uid cannot read its environment (the workers' keys). An answer that loops,
crashes or exits scores 0. It is a guard against mistakes and casual snooping, not a security
boundary against a determined answer (see that module).

Pure functions; reading an answer never raises (a grader that cannot read an answer scores it 0
and says so in `detail`). Shared readers (choice letters, the "answer is" marker and `\\boxed{}`,
span normalisation, Python extraction) come from router/answers.py, so a letter is read the same
way here and in the cascade. What only a grader reads is here, on top of them: the commitment of an
answer that goes through the options ("A) Mars is too small … C) Jupiter is the largest, so the
answer is C"; its leading "A)" is no choice, and "the answer is A or C" is none), a closing option
line ("**C) Jupiter**" after the reasoning) and code split over several fenced blocks (an import or
a helper, then the function). They stay out of router/answers.py on purpose: its readers also serve
the live planner and the offline evaluation, whose published figures and code-run cache depend on
them as they are.
"""

from __future__ import annotations

import ast
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.answers import (
    AFTER_LETTER,
    ANSWER_MARK,
    BOXED_OPTION,
    FENCE,
    WRAPPER,
    choice_key,
    last_boxed,
    marked_letter,
    parse_python,
    python_source,
    span_key,
)
from router.code_behaviour import run_behaviour

if TYPE_CHECKING:
    from router.probes import Probe

CODE_TIMEOUT_S = 15.0  # the whole test run of one answer
CODE_PER_CALL_S = 3.0  # one statement or one test: generous, the machine may be busy


@dataclass(frozen=True, slots=True)
class Grade:
    score: float  # 0..1
    extracted: str | None  # what the grader read from the answer (a letter, a number, ...)
    detail: str  # for people: why this score


# ---- choice -----------------------------------------------------------------------------------------
_MARKDOWN = re.compile(r"[*_`]+")
_BRACKETED = re.compile(r"[\(\[]([A-J])[\)\]]")
_OPTION_LINE = re.compile(r"[\(\[]?([A-J])\)")  # a line that starts "C)" or "(C)": an option as listed
_OPTION_NAMED = re.compile(r"(?<![A-Za-z0-9])[\(\[]?([A-J])\)")
_B = r"[^\S\n]"  # a blank within a line: no reader crosses a line end between a marker and its letter
# An option as a committed answer names it: "C", "C)", "(C)", "option C", "choice (C)".
_NAMED = rf"(?:(?i:option|choice){_B}+)?[\(\[]?(?P<letter>[A-J]){AFTER_LETTER}"
# Other ways an answer commits to one option, each followed by the option (group "letter").
_COMMITS = (
    # "the correct option is C", "the right choice: (C)", "the final one would be C"
    re.compile(
        rf"\b(?i:correct|right|final){_B}+(?i:option|choice|one|pick)"
        rf"(?:{_B}+(?i:is|would{_B}+be))?(?:{_B}*:)?{_B}*" + _NAMED
    ),
    # "I'd go with C", "I choose (C)", "picking option C"
    re.compile(
        rf"\b(?i:choose|chose|choosing|pick|picked|picking|select|selected|selecting"
        rf"|go{_B}+with|going{_B}+with|opt{_B}+for|settle{_B}+on){_B}+" + _NAMED
    ),
    # "so C.", "Therefore, C) Jupiter.", "so it's (C)", "That leaves C": checked by _ends_a_claim
    re.compile(
        rf"\b(?i:so|therefore|thus|hence|leaves|leaving)(?:{_B}*,)?{_B}*"
        rf"(?:(?i:it's|it{_B}+is|it{_B}+must{_B}+be|that's|that{_B}+is|only|us{_B}+with){_B}+)?" + _NAMED
    ),
)
# "C is correct", "C) is right", "C) Jupiter is the correct answer", "Option C (Jupiter) is the answer":
# the option comes first. Words between a bare letter and "is" are not allowed ("A planet is the
# right answer" names no option); after "C)" or "option C" up to four are (the option's text).
_IS_RIGHT = re.compile(
    rf"(?<![A-Za-z0-9])(?:(?:(?i:option|choice){_B}+[\(\[]?(?P<named>[A-J])[\)\]]?"
    rf"|[\(\[]?(?P<listed>[A-J])[\)\]])"
    rf"(?:{_B}+\([^()\n]{{0,60}}\)|(?:{_B}+[^\s.!?;,()]+){{0,4}}?)|(?P<bare>[A-J]))"
    rf"{_B}+(?i:is){_B}+(?:(?i:the){_B}+)?(?:(?i:correct|right)\b|(?i:answer)\b)"
)
_VERB = re.compile(r"\b(?:is|are|was|were|am|would|could|can|cannot|can't|does|doesn't|has|have|seems?)\b")
# An option stated after "is" ("the largest is C) Jupiter", "it is (C)", "the best fit is option C"):
# how an answer that compares options states its choice ("Between A) Mars and C) Jupiter, the largest
# is C) Jupiter."). Option forms only: after "is" a bare letter may be the article ("is A planet"), and
# "B and C are both plausible, but the best is C" stays a hedge. Checked by _states_option.
_IS_OPTION = re.compile(
    rf"\b(?i:is){_B}+(?:(?i:option|choice){_B}+[\(\[]?(?P<named>[A-J]){AFTER_LETTER}"
    rf"|[\(\[]?(?P<listed>[A-J])(?=[\)\]]))"
)
# "The first is A) Mars", "the other one is (B)": an option described by its place in a list, not chosen.
_ORDINAL_BEFORE = re.compile(
    rf"\b(?i:first|second|third|fourth|fifth|last|next|other|another)(?:{_B}+(?i:one|option|choice))?{_B}*$"
)
_SENTENCE_END = re.compile(r"[.!?;\n]")
# Another option right after the one read: "A or C", "(A) or (C)", "A, C", "A) Mars or C) Jupiter".
_OTHER_NEAR = re.compile(
    rf"[\)\]]?{_B}*(?:,|/|&|\bor\b|\band\b){_B}*(?:(?i:option|choice){_B}+)?"
    rf"[\(\[]?(?P<letter>[A-J]){AFTER_LETTER}"
)
_OTHER_FAR = re.compile(
    rf"[\)\]](?:{_B}+[^\s,/&()\[\]]+){{1,4}}?{_B}*(?:,|\bor\b|\band\b){_B}*[\(\[]?(?P<letter>[A-J])[\)\]]"
)
_OTHER_BEFORE = re.compile(
    rf"(?<![A-Za-z0-9])[\(\[]?[A-J][\)\]]?{_B}*(?:,|/|&|\bor\b|\band\b){_B}*(?:(?i:option|choice){_B}+)?$"
)
# An option named where a sentence, a line or a list item starts, as an answer that goes through the
# options names them: "A) Mars …", "(B) …", "- C. …" (at a line start only), "Option D …", "A is …".
_SENTENCE_START = rf"(?:\A|(?<=[\n.;:!?…,])){_B}*(?:[-*•>]+{_B}*|\d{{1,3}}[.)]{_B}*)?"
_LABEL = re.compile(
    _SENTENCE_START
    + rf"(?:(?i:option|choice){_B}+[\(\[]?(?P<named>[A-J]){AFTER_LETTER}|[\(\[](?P<bracketed>[A-J])[\)\]]"
    + rf"|(?P<listed>[A-J])[\)\]]|(?P<bare>[A-J])(?={_B}+(?:is|are|was|seems)\b))"
)
_LINE_LABEL = re.compile(rf"(?m)^{_B}*(?:[-*•>]+{_B}*)?(?P<letter>[A-J])[.:]{_B}")
# A verdict inside one option's part of a walk: "C) Jupiter - correct", "C) … This is correct.", "✓".
_RIGHT_VERDICT = re.compile(
    rf"(?:[-—–:→=]|\b(?i:is|are)\b){_B}*(?:(?i:the){_B}+)?(?i:correct|right)\b"
    rf"(?!{_B}+(?i:if|only|when|about|that|to|in)\b)|\((?i:correct|right)\)|[✓✔✅]"
)
# A leading option called wrong ("A is wrong", "A) is too small", "A - incorrect", "A ✗"): not the choice.
_WRONG_LEAD = re.compile(
    rf"[\)\]]?{_B}*(?:(?:is|are|seems){_B}+(?:wrong|incorrect|false|not\b|out\b|too\b)"
    rf"|[-—–:]{_B}*(?i:wrong|incorrect|false)|[✗✘❌])"
)
_LEAD = re.compile(rf"\s*(?:(?i:option|choice){_B}+)?[\(\[]?(?P<letter>[A-J])(?:[\)\]\.:,]|{_B}|$)")
# A leading "A" that is the article: a blank, then an ordinary lower-case word that can follow "a" in a
# noun phrase ("A planet that is large …"). A chosen "A" is followed by a mark ("A)", "A.", "A,") or
# by a reason or a verb ("A because …", "A is …", "A and C"), which this leaves out.
_ARTICLE_LEAD = re.compile(
    rf"\s*A{_B}+(?!(?:because|since|as|given|for|due|but|and|or|nor|so|then|than|not|is|was|are|were"
    rf"|seems?|would|could|should|must|might|may|can|will|fits?|matches|works|wins|looks|appears|only"
    rf"|too|also|vs|versus|if|when|while|though|although|unless|with|without|over|instead)\b)[a-z]"
)


def _another_option(text: str, end: int, letters: str) -> bool:
    """Another offered option is named as an alternative right after position `end` ("A or C",
    "(A) or (C)", "A) Mars or C) Jupiter"): the read option is not a commitment. "C, not A" and
    "C, and A is wrong" name no alternative."""
    for pattern in (_OTHER_NEAR, _OTHER_FAR):
        found = pattern.match(text, end)
        if found is not None and found.group("letter") in letters:
            rest = text[found.end() : found.end() + 20].lstrip(")] ")
            if _VERB.match(rest) is None:
                return True
    return False


def _ends_a_claim(text: str, end: int) -> bool:
    """After "so"/"therefore"/"leaves", the option ends the sentence ("so C.", "Therefore, C)
    Jupiter."): "so A) Mars is too small" and "Therefore, B and C are wrong" say something about
    an option without choosing it."""
    rest = re.split(r"[.!?;\n]", text[end : end + 80], maxsplit=1)[0]
    return _VERB.search(rest) is None


def _states_option(text: str, found: re.Match[str], end: int) -> bool:
    """After "is", the option ends a statement ("the largest is C) Jupiter.", "… is C) Jupiter, not
    A) Mars"): "what is C) made of?" asks, "the one that is A) Mars is too small" and "the closest is
    A) Mars, which is too small" say something about the option, "the first is A) Mars" lists it."""
    window = text[end : end + 80]
    stop = _SENTENCE_END.search(window)
    rest = window[: stop.start()] if stop else window
    if (stop is not None and stop.group() == "?") or _VERB.search(rest) is not None:
        return False
    start = found.start()
    return _ORDINAL_BEFORE.search(text[max(0, start - 30) : start]) is None


def _stated_option(plain: str, letters: str) -> str | None:
    """The option the last "… is C) Jupiter" statement names, or None when there is none or it names
    another option as an alternative ("the largest is A) Mars or C) Jupiter"). Read only where no
    stronger reading exists (see chosen_letter): it is the weakest form of commitment."""
    last: tuple[str, bool] | None = None
    for found in _IS_OPTION.finditer(plain):
        group = "named" if found.group("named") else "listed"
        letter, end = found.group(group), found.end(group)
        if letter in letters and _states_option(plain, found, end):
            last = (letter, _another_option(plain, end, letters))
    return last[0] if last is not None and not last[1] else None


def _later_choice(plain: str, letters: str) -> str | None:
    """After a leading article "A" ("A planet that is large is C) Jupiter."), the option the answer
    goes on to state: the last "… is C) Jupiter", else the one offered option written as an option
    ("C)", "(C)", "option C") where a later sentence or line starts ("A large planet.\nC) Jupiter").
    None when it states none, names several that way or one with an alternative ("C) Jupiter and D)
    Saturn"): then the old reading stands."""
    if (stated := _stated_option(plain, letters)) is not None:
        return stated
    named = set()
    for found in _LABEL.finditer(plain, 1):
        group = next(g for g in ("named", "bracketed", "listed", "bare") if found.group(g))
        if group == "bare" or found.group(group) not in letters:
            continue  # a bare "C is …" is a walk's or a claim's, read elsewhere
        if _another_option(plain, found.end(group), letters):
            return None
        named.add(found.group(group))
    return named.pop() if len(named) == 1 else None


def _boxed_option(plain: str, letters: str) -> str | None:
    """The option in the last `\\boxed{}` ("\\boxed{C}", "\\boxed{\\text{(C)}}", "\\boxed{C) Jupiter}"),
    read as the planner reads it; "" when the box names it with an alternative ("\\boxed{A \\text{ or
    } C}"), None when the box holds no option."""
    content = last_boxed(plain)
    if content is None:
        return None
    core = WRAPPER.sub(r"\1", content).strip(" $*\t\n")
    found = BOXED_OPTION.match(core)
    if found is None or (letter := found.group(1).upper()) not in letters:
        return None
    return "" if _another_option(core, found.end(1), letters) else letter


def _commitment(plain: str, letters: str) -> tuple[bool, str | None]:
    """The option the answer commits to, and whether it commits at all: `\\boxed{C}`, else the last
    explicit answer ("so the answer is C"), else the last other commitment ("I'd go with C", "C is
    correct", "Therefore, C) Jupiter."). (True, None) when that commitment names another option as
    an alternative ("the answer is A or C"): a hedged final answer is no choice."""
    boxed = _boxed_option(plain, letters)
    if boxed is not None:
        return True, boxed or None
    # the planner's marker and reading ("The answer is (B)", "Answer: C", "answer: d" but not "the
    # answer is a drought"); the markdown it allows is gone from `plain` already
    answers = [
        (m, letter) for m in ANSWER_MARK.finditer(plain) if (letter := marked_letter(m)) and letter in letters
    ]
    if answers:
        found, letter = answers[-1]
        return True, None if _another_option(plain, found.end(), letters) else letter
    others: list[tuple[int, str, bool]] = []
    for index, pattern in enumerate(_COMMITS):
        for found in pattern.finditer(plain):
            letter = found.group("letter")
            if letter not in letters or (index == 2 and not _ends_a_claim(plain, found.end())):
                continue
            others.append((found.start("letter"), letter, _another_option(plain, found.end(), letters)))
    for found in _IS_RIGHT.finditer(plain):
        letter = found.group("named") or found.group("listed") or found.group("bare")
        if letter in letters:
            start = found.start()
            hedged = _OTHER_BEFORE.search(plain[max(0, start - 40) : start]) is not None
            others.append((start, letter, hedged))
    if not others:
        return False, None
    _, letter, hedged = max(others)
    return True, None if hedged else letter


def _labels(plain: str, letters: str) -> list[tuple[int, str]]:
    """The offered options named where a sentence, line or list item starts, in order: how an answer
    that goes through the options names them."""
    found = [
        (m.start(), letter)
        for m in _LABEL.finditer(plain)
        if (letter := m.group("named") or m.group("bracketed") or m.group("listed") or m.group("bare"))
        in letters
    ]
    found += [
        (m.start(), m.group("letter")) for m in _LINE_LABEL.finditer(plain) if m.group("letter") in letters
    ]
    return sorted(set(found))


def _walks_through_options(labels: list[tuple[int, str]]) -> bool:
    """The answer goes through the options ("A) Mars is too small … C) Jupiter is the largest."):
    it names two or more at sentence starts, the first being the lowest letter it names. Its leading
    "A)" is where it starts going through them, not a choice. An answer that leads with its choice
    and then names others ("C) Jupiter. A) Mars is too small.") starts above the lowest."""
    named = list(dict.fromkeys(letter for _, letter in labels))
    return len(named) >= 2 and named[0] == min(named)


def _single_verdict(plain: str, labels: list[tuple[int, str]]) -> str | None:
    """In a walk through the options, the one option whose part says it is right ("C) Jupiter -
    correct", "C) … This is correct.", "C) Jupiter ✓"), when exactly one does."""
    bounds = [start for start, _ in labels] + [len(plain)]
    right = {
        letter
        for (start, letter), end in zip(labels, bounds[1:], strict=True)
        if _RIGHT_VERDICT.search(plain, start + 1, end) is not None
    }
    return right.pop() if len(right) == 1 else None


def _closing_line(plain: str, letters: str) -> str | None:
    """The answer's last line when it is its choice: a letter alone ("…\\n\\nC"), or an option line
    ("…\\n\\n**C) Jupiter**") that names no other option and either does not follow an option line
    (a listing of the options chooses none) or restates an option named above (the choice after a
    walk through the options)."""
    lines = [line.strip() for line in plain.splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1].strip(" .")
    if len(last) == 1 and last in letters:
        return last
    if (found := _OPTION_LINE.match(lines[-1])) is None or found.group(1) not in letters:
        return None
    letter = found.group(1)
    if {m.group(1) for m in _OPTION_NAMED.finditer(lines[-1])} != {letter}:
        return None
    if len(lines) > 1 and _OPTION_LINE.match(lines[-2]):
        above = "\n".join(lines[:-1])
        if letter not in {m.group(1) for m in _OPTION_NAMED.finditer(above)}:
            return None
    return letter


def _lone_letter_line(plain: str, letters: str) -> str | None:
    """The first line that holds only an offered letter ("C" before the reasoning)."""
    for line in plain.splitlines():
        core = line.strip(" .")
        if len(core) == 1 and core in letters:
            return core
    return None


def chosen_letter(answer: str, letters: str) -> str | None:
    """The option the answer commits to, or None when it commits to none.

    In order: a lone letter ("C", "c"); a commitment (`\\boxed{C}`, the last "the answer is C" /
    "Answer: C", else the last "I'd go with C", "the correct option is C", "C is correct", "so C.",
    "Therefore, C) Jupiter.", "That leaves C"), unless it names another option as an alternative
    ("the answer is A or C": none); a closing line that is the choice ("…\\n\\n**C) Jupiter**").
    An answer that goes through the options ("A) Mars is too small … C) Jupiter is the largest")
    chooses only so, or by the one option it calls right ("C) Jupiter - correct"): its leading
    "A)" is no choice. Otherwise router.answers.choice_key on the answer without markdown (a
    leading "C) Jupiter", "option C", a line holding only "C"), else the one offered letter it names
    in brackets ("I'd pick (C) iron"); a leading option named with another as an alternative ("A)
    Mars or C) Jupiter", "A or B") or called wrong ("A is wrong") chooses none. A leading article
    "A" ("A planet that is large is C) Jupiter.") is no choice when the answer goes on to state
    one option (_later_choice).

    An answer that compares options and commits in none of those forms is read at the last option
    it states after "is" ("Between A) Mars and C) Jupiter, the largest is C) Jupiter."), in a walk
    and after a hedged or rejected leading option too; never over a leading option it commits to
    ("C) Jupiter. The smallest is A) Mars." reads C), and never from a question ("A) Mars or C)
    Jupiter? I am not sure." reads none)."""
    plain = _MARKDOWN.sub("", answer or "").replace("is:", "is")
    core = plain.strip(" .\n")
    if len(core) == 1 and core.upper() in letters:
        return core.upper()  # a lone letter, even lower case
    commits, letter = _commitment(plain, letters)
    if commits:
        return letter
    if (closing := _closing_line(plain, letters)) is not None:
        return closing
    labels = _labels(plain, letters)
    if _walks_through_options(labels):
        return (
            _single_verdict(plain, labels)
            or _lone_letter_line(plain, letters)
            or _stated_option(plain, letters)
        )
    lead = _LEAD.match(plain)
    if lead is not None and lead.group("letter") in letters:
        if _another_option(plain, lead.end("letter"), letters) or _WRONG_LEAD.match(
            plain, lead.end("letter")
        ):
            return _stated_option(plain, letters)  # "A) Mars or C) Jupiter? The largest is C) Jupiter."
        if _ARTICLE_LEAD.match(plain) and (later := _later_choice(plain, letters)) is not None:
            return later  # "A planet that is large is C) Jupiter.": the article "A" is no choice
    chosen = choice_key(plain, letters)  # before a stated option: "I think option B. The worst is A) Mars."
    if chosen is not None:
        return chosen
    if lead is None and (stated := _stated_option(plain, letters)) is not None:
        return stated  # no leading option: "Between A) Mars and C) Jupiter, the largest is C) Jupiter."
    named = {m.group(1) for m in _BRACKETED.finditer(plain) if m.group(1) in letters}
    return named.pop() if len(named) == 1 else None


def grade_choice(answer: str, gold: str, letters: str = "ABCD") -> Grade:
    chosen = chosen_letter(answer, letters)
    if chosen is None:
        return Grade(0.0, None, f"no option letter ({letters}) found")
    right = chosen == gold
    return Grade(1.0 if right else 0.0, chosen, f"chose {chosen}, gold {gold}")


# ---- number -----------------------------------------------------------------------------------------
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{\s*(-?\d+(?:\.\d+)?)\s*\}\{\s*(\d+(?:\.\d+)?)\s*\}$")
_SHORT_FRAC = re.compile(r"^(-?)\\[dt]?frac(\d)(\d)$")  # \frac32
_SLASH = re.compile(r"^(-?\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)$")
_PLAIN = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?$", re.IGNORECASE)
# A unit with its power: "12\\text{ cm}^2" is 12 (square centimetres), not 12^2 and not 2.
_TEXT = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}(?:\^\{?\d\}?)?")
# One number as written in an answer: a LaTeX fraction, a/b, or a decimal with thousands separators.
_TOKEN = re.compile(
    r"-?\\[dt]?frac\{\s*-?\d+(?:\.\d+)?\s*\}\{\s*\d+(?:\.\d+)?\s*\}"
    r"|-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
    r"|-?\.\d+"
)
# "Answer:", "answer is", "**Answer**: 7", "__Answer__: 7", "Answer — 7", "####": markdown emphasis may
# close between the word and its colon.
_MARKER = re.compile(r"(?<![a-z])answer[*_]*\s*(?:is\b|[:\u2014\u2013])|####", re.IGNORECASE)
# A thousands separator inside a number: LaTeX's thin and other spaces (1\,234, 1\;234, 1\ 234, 1~234)
# and the Unicode thin, narrow no-break and no-break spaces (SI style): otherwise 1 and 234 are read.
_GROUP_SPACE = re.compile(r"(?<=\d)(?:\\[,;: !]|~|[\u2009\u202f\u00a0])(?=\d{3}(?!\d))")


# "1 234" with plain spaces (SI style) is one number only where an answer states its final number:
# right after "Answer:"/"####" (a box's content is read whole already). In prose "3 100" is as often
# two numbers, so elsewhere the last number is read as before.
_SPACED_GROUPS = re.compile(r"(-?\d{1,3}(?: \d{3})+(?:\.\d+)?)(?![\d.,-]?\d)(?!\s*[-/])")


def parse_number(text: str) -> float | None:
    """A number as a final answer writes it: "18", "-0.5", "1,234", "$20,000.", "3/4", "\\frac{3}{4}",
    "\\dfrac32", "45\\%", "12 \\text{cm}", "12\\text{ cm}^2", "10{,}000", "−5" (Unicode minus); None when
    it is something else (an expression, words)."""
    t = _TEXT.sub("", _plain_signs(text or "")).strip()
    for noise in ("\\$", "$", "\\!", "\\,", "\\%", "%", "^\\circ", "^{\\circ}", "\\left", "\\right", "**"):
        t = t.replace(noise, "")
    t = t.replace(",", "").replace(" ", "").rstrip(".").strip("()")
    found = _FRAC.match(t) or _SHORT_FRAC.match(t)
    if found:
        numerator, denominator = float(found.group(2)), float(found.group(3))
        value = numerator / denominator if denominator else None
        return -value if value is not None and found.group(1) else value
    found = _SLASH.match(t)
    if found:
        denominator = float(found.group(2))
        return float(found.group(1)) / denominator if denominator else None
    if _PLAIN.match(t):
        value = float(t)
        return value if math.isfinite(value) else None
    return None


def _plain_signs(text: str) -> str:
    """LaTeX's thousands separator `{,}` (MATH writes 10{,}000) as a comma, a space between digit
    groups (`1\\,234`, U+202F) dropped, and the Unicode minus (U+2212) as "-": otherwise a reader sees
    "000", "1" or "5"."""
    return _GROUP_SPACE.sub("", text.replace("{,}", ",").replace("\u2212", "-"))


def final_number(answer: str) -> tuple[str | None, float | None]:
    """The answer's final number as written and its value: a `\\boxed{}` that holds a number, else the
    first number after the last "Answer:"/"**Answer**:"/"answer is"/"####", else the last number in
    the answer."""
    answer = _plain_signs(answer)
    boxed = last_boxed(answer)
    if boxed is not None and (value := parse_number(boxed)) is not None:
        return boxed.strip(), value
    markers = list(_MARKER.finditer(answer))
    if markers:
        tail = answer[markers[-1].end() :]
        if (spaced := _SPACED_GROUPS.match(tail.lstrip(" *_$"))) is not None:
            return spaced.group(1), float(spaced.group(1).replace(" ", ""))
        for token in _TOKEN.findall(tail):
            if (value := parse_number(token)) is not None:
                return token.strip(), value
    for token in reversed(_TOKEN.findall(answer)):
        if (value := parse_number(token)) is not None:
            return token.strip(), value
    return None, None


def grade_number(answer: str, gold: str, rel_tol: float = 1e-6) -> Grade:
    expected = parse_number(gold)
    if expected is None:
        raise ValueError(f"gold {gold!r} is not a number")
    written, value = final_number(answer or "")
    if value is None:
        return Grade(0.0, None, "no number found")
    right = math.isclose(value, expected, rel_tol=rel_tol, abs_tol=1e-9)
    return Grade(1.0 if right else 0.0, written, f"read {written}, gold {gold}")


# ---- match ------------------------------------------------------------------------------------------
def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's token F1 between two normalised strings."""
    pred, ref = prediction.split(), reference.split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def folded_key(text: str) -> str | None:
    """router.answers.span_key without accents: "Zürich", "Zurich" and "ZURICH" are one answer, as
    are "café" and "cafe" (a worker's spelling of a name is not its knowledge of it). Letters that
    decompose (ü → u + ¨) lose their marks; others (ß, ø) stay as they are."""
    decomposed = unicodedata.normalize("NFKD", text)
    return span_key("".join(c for c in decomposed if not unicodedata.combining(c)))


def grade_match(answer: str, golds: Sequence[str], partial: str | None = "f1") -> Grade:
    """1 when an accepted answer, normalised, appears whole in the normalised answer (workers add
    words: "It was Bayreuth."); otherwise the best token F1 against an accepted answer with
    `partial="f1"` (LLMRouter's metric for these tasks), or 0. Accents are ignored on both sides
    (:func:`folded_key`)."""
    said = folded_key(answer or "")
    accepted = [key for g in golds if (key := folded_key(str(g)))]
    if not accepted:
        raise ValueError("no usable accepted answer")
    if said is None:
        return Grade(0.0, None, "empty answer")
    for key in accepted:
        if f" {key} " in f" {said} ":
            return Grade(1.0, said, f"contains {key!r}")
    if partial == "f1":
        best = max(token_f1(said, key) for key in accepted)
        return Grade(round(best, 4), said, f"token F1 {best:.2f} against {accepted[0]!r}")
    return Grade(0.0, said, f"does not contain {accepted[0]!r}")


# ---- code -------------------------------------------------------------------------------------------
def graded_source(answer: str) -> str | None:
    """The Python a code answer is graded on: its fenced Python blocks that parse, joined in order,
    when they define a function or class (an import or a helper in one block, the function in the
    next: "```python\\nimport math\\n```" then "```python\\ndef f(x): ...```"), else
    router.answers.python_source (the first block with a function, a [PYTHON] block, or the whole
    answer). The test run executes the program statement by statement, so a usage block joined in
    (a print, an input()) hides no function. Grading only: the planner's and the offline
    evaluation's readers stay router.answers.python_source."""
    blocks = [block.strip("\n") for block in FENCE.findall(answer)]
    parsed = [block for block in blocks if parse_python(block) is not None]
    if len(parsed) > 1:
        joined = "\n\n".join(parsed)
        tree = parse_python(joined)
        if tree is not None and any(isinstance(node, ast.FunctionDef | ast.ClassDef) for node in tree.body):
            return joined
    return python_source(answer)


def grade_code(
    answer: str,
    tests: Sequence[str],
    setup: str | None = None,
    *,
    timeout_s: float = CODE_TIMEOUT_S,
    per_call_s: float = CODE_PER_CALL_S,
) -> Grade:
    """Run the answer's Python, after `setup` (a stub's imports and helpers), against `tests` (single
    asserts; each calls the task's function, which is bound to the answer's main function). Blocking:
    call it from a thread in async code."""
    source = graded_source(answer or "")
    if source is None:
        return Grade(0.0, None, "no Python function found in the answer")
    program = f"{setup.rstrip()}\n\n{source}" if setup else source
    behaviour = run_behaviour([program], [], list(tests), timeout_s=timeout_s, per_call_s=per_call_s)[0]
    if behaviour is None or behaviour.assert_pass is None:
        return Grade(0.0, None, f"the test run did not finish (timeout {timeout_s:g} s or a crash)")
    passed = round(behaviour.assert_pass * len(tests))
    return Grade(
        1.0 if passed == len(tests) else 0.0,
        f"{passed}/{len(tests)}",
        f"passed {passed} of {len(tests)} tests",
    )


# ---- dispatch ---------------------------------------------------------------------------------------
def grade(probe: Probe, answer: str) -> Grade:
    """Grade `answer` to `probe` with its type's grader and the probe's parameters."""
    params = probe.grader
    if probe.type == "choice":
        return grade_choice(answer, str(probe.gold), str(params.get("letters", "ABCD")))
    if probe.type == "number":
        return grade_number(answer, str(probe.gold), float(params.get("rel_tol", 1e-6)))
    if probe.type == "match":
        golds = probe.gold if isinstance(probe.gold, list) else [str(probe.gold)]
        return grade_match(answer, golds, params.get("partial", "f1"))
    return grade_code(
        answer,
        probe.tests,
        probe.setup,
        timeout_s=float(params.get("timeout_s", CODE_TIMEOUT_S)),
        per_call_s=float(params.get("per_call_s", CODE_PER_CALL_S)),
    )
