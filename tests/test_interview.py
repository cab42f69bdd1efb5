"""Interview answers read aloud: each lab page's "Interview: how to say it out loud" section holds a
spoken summary and questions, and every spoken answer is what a person would say.

On a lab page the section reads: the summary (paragraphs), then for each ``??? question`` its spoken
answer (paragraphs) and one collapsed ``??? info "Follow-up: ..."`` with the precise figures and
where each comes from (traced, measured, derived or cited). The spoken part is 3 to 5 sentences, none
over 40 words, with no flag, no provenance tag, no placeholder and at most one figure of two or more
decimals; the build hook's spoken kinds (``{{ lab-13:peak_8b | bytes~ }}`` -> "about 150 GiB")
round the numbers it says. The drill on the interview page deals the same questions (tests/test_browser.py).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from bs4 import BeautifulSoup, Tag

ROOT = Path(__file__).resolve().parents[1]
LAB_PAGES = sorted((ROOT / "docs" / "labs").glob("lab-*.md"))
SECTION = "interview-how-to-say-it-out-loud"
FOLLOW_UP = "Follow-up"

ABBREVIATIONS = re.compile(r"\b(?:e\.g|i\.e|et al|etc|vs|cf)\.", re.I)
SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"”’)]))\s+(?=\S)")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
KINDS = r"(?:traced|measured|derived|cited)"
TAG = re.compile(rf"\([^()]*\b{KINDS}\b[^()]*\)|,\s*{KINDS}\b(?: on fake tensors| at real scale)?\s*[,:;.)]", re.I)
PRECISE = re.compile(r"\d+\.\d{2,}")


def sentences(text: str) -> list[str]:
    """A paragraph's sentences: split where . ! ? (and a closing quote) meet a space (not after e.g.)."""
    text = ABBREVIATIONS.sub(lambda m: m.group(0).replace(".", "\0"), " ".join(text.split()))
    return [s.replace("\0", ".") for s in SENTENCE_END.split(text) if s.strip()]


def words(sentence: str) -> int:
    return len([w for w in sentence.split() if re.search(r"\w", w)])


def _text(node: Tag) -> str:
    return " ".join(node.get_text(" ").split())


def spoken_answers(html: str) -> list[tuple[str, list[Tag], list[Tag]]]:
    """(label, spoken paragraphs, follow-ups) for the summary and each question of a built lab page's
    interview section. The spoken part is every direct child paragraph; anything else beside a summary
    or a follow-up is returned as a paragraph too, so that a list or table in a spoken answer fails."""
    soup = BeautifulSoup(html, "html.parser")
    head = soup.find("h2", id=SECTION)
    assert head is not None, "no interview section"
    out, summary, follow = [], [], []
    for node in head.find_next_siblings():
        if node.name == "h2":
            break
        if node.name == "details" and "question" in node.get("class", []):
            kids = [k for k in node.children if isinstance(k, Tag) and k.name != "summary"]
            ups = [k for k in kids if k.name == "details"]
            out.append((_text(node.find("summary")), [k for k in kids if k.name != "details"], ups))
        elif node.name == "details":
            follow.append(node)
        else:
            summary.append(node)
    return [("summary", summary, follow), *out]


def problems_of(label: str, paragraphs: list[Tag]) -> list[str]:
    """What a person could not say out loud, in words."""
    text = " ".join(_text(p) for p in paragraphs)
    found = []
    said = sentences(text)
    if not 3 <= len(said) <= 5:
        found.append(f"{label}: {len(said)} sentences (3 to 5)")
    found += [f"{label}: {words(s)} words: {s[:60]}..." for s in said if words(s) > 40]
    found += [f"{label}: a flag read aloud: {f}" for f in FLAG.findall(text)]
    found += [f"{label}: a tag read aloud: {t.group(0)}" for s in said if (t := TAG.search(s))]
    found += [f"{label}: a tag read aloud: {p.get_text()}" for para in paragraphs for p in para.select(".il-tag")]
    if "{{" in text or "}}" in text:
        found.append(f"{label}: a placeholder left in")
    if len(PRECISE.findall(text)) > 1:
        found.append(f"{label}: precise figures {PRECISE.findall(text)}")
    found += [f"{label}: a {p.name} in the spoken part" for p in paragraphs if p.name != "p"]
    return found


@pytest.fixture(scope="module")
def lab_html(built_site) -> dict[str, str]:
    return {page.stem: (built_site["dir"] / "labs" / page.stem / "index.html").read_text(encoding="utf-8")
            for page in LAB_PAGES}


def test_every_spoken_answer_is_three_to_five_short_plain_sentences(lab_html):
    problems, answers = [], 0
    for stem, html in lab_html.items():
        for label, paragraphs, _ in spoken_answers(html):
            answers += 1
            problems += [f"{stem}: {p}" for p in problems_of(label, paragraphs)]
    assert answers >= 14 + 40, answers
    assert not problems, "\n".join(problems)


def test_every_answer_has_one_collapsed_follow_up_with_its_figures(lab_html):
    """The precise figures and their provenance are behind a closed follow-up, one per answer."""
    for stem, html in lab_html.items():
        for label, _, follow in spoken_answers(html):
            assert len(follow) == 1, (stem, label, len(follow))
            up = follow[0]
            assert not up.has_attr("open") and FOLLOW_UP in _text(up.find("summary")), (stem, label)
            body = _text(up)
            assert re.search(r"\b(traced|measured|derived|cited)\b", body), (stem, label, "says where its figures come from")


def test_the_interview_page_deals_the_same_answers(built_site, lab_html):
    """docs/interview.md gathers the sections: the same questions, each with its follow-up inside, which
    the drill copies as it is (a closed follow-up under the spoken answer)."""
    soup = BeautifulSoup((built_site["dir"] / "interview" / "index.html").read_text(encoding="utf-8"), "html.parser")
    questions = soup.select("article details.question")
    on_labs = [label for html in lab_html.values() for label, _, _ in spoken_answers(html)[1:]]
    assert [_text(q.find("summary")) for q in questions] == on_labs
    for q in questions:
        ups = [k for k in q.children if isinstance(k, Tag) and k.name == "details"]
        assert len(ups) == 1 and "question" not in ups[0].get("class", []), _text(q.find("summary"))


def test_llama_8b_on_one_h100_is_answered_in_words(lab_html):
    """No at 16 bytes per parameter; yes with LoRA or QLoRA, 8-bit Adam with checkpointing, optimizer
    offload, or two GPUs, each with its number behind it in the follow-up."""
    answers = {label: (paragraphs, follow) for label, paragraphs, follow in spoken_answers(lab_html["lab-13-will-it-fit"])}
    label = next(k for k in answers if k.startswith("Does Llama-3-8B train on one"))
    paragraphs, follow = answers[label]
    said = " ".join(_text(p) for p in paragraphs)
    for words_ in ("16 bytes per parameter", "LoRA", "QLoRA", "8-bit Adam", "checkpointing", "offload", "two GPUs"):
        assert words_ in said, words_
    assert said.startswith("No"), said[:40]
    behind = _text(follow[0])
    for words_ in ("traced", "derived", "Lab 07", "2 ranks"):
        assert words_ in behind, words_


def hooks():
    spec = importlib.util.spec_from_file_location("infralab_hooks_spoken", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("value", "kind", "said"), [
    (160_605_390_848, "bytes~", "about 150 GiB"), (16 << 30, "bytes~", "16 GiB"), (3076 << 30, "bytes~", "about 3 TiB"),
    (15_021_648_117, "bytes~", "about 14 GiB"), (569_083_166, "bytes~1", "about 500 MiB"), (128.48e9, "GB~", "about 130 GB"),
    (194, "int~", "about 190"), (16_384, "int~", "about 16,000"), (0.614, "pct~", "about 61 %"), (2.85, "x~", "about 2.9 times"),
    (0.5278, "float~", "about 0.53"), (512, "bytes~", "512 bytes"), (128 << 10, "bytes~", "128 KiB"), (54, "int~", "54"),
])
def test_a_spoken_kind_rounds_as_a_person_says_it(value, kind, said):
    assert hooks().spoken(value, kind) == said


def test_a_spoken_kind_refuses_what_it_cannot_say():
    h = hooks()
    for value, kind in ((0, "bytes~"), ("fp32", "int~"), (True, "int~"), (5, "furlongs~")):
        with pytest.raises(ValueError):
            h.spoken(value, kind)


def test_the_sentence_counter_counts_what_a_reader_hears():
    assert sentences("No. At 16 bytes per parameter, e.g. AdamW in mixed precision, it is 0.53 s. Yes.") == [
        "No.", "At 16 bytes per parameter, e.g. AdamW in mixed precision, it is 0.53 s.", "Yes."]
    assert sentences("Lab 01's formula (Dettmers et al. 2022) holds. \"It fits,\" I say.") == [
        "Lab 01's formula (Dettmers et al. 2022) holds.", "\"It fits,\" I say."]
