"""Build data/sample.jsonl: real-text conversations from what a Python install carries.

    .venv/bin/python scripts/build_sample_data.py            # writes data/sample.jsonl, data/SOURCES.md

The sample set must be redistributable and must not need a download, so it is made from
three sources every install has: the language-reference topics of `pydoc_data.topics`
(PSF licence), docstrings of standard-library modules, classes and functions (PSF), and
the long descriptions of installed packages under permissive licences (named in
data/SOURCES.md). A user asks about a topic in one of several natural phrasings, the
assistant answers with the cleaned text; some conversations carry a system prompt, some
are multi-turn (a short first exchange, or a long section continued in a second turn).

The output is deterministic for a given set of installed packages and Python version:
every choice is a hash of the passage's key, never a random draw, and conversations are
written sorted by key. Because it depends on the machine, the committed file is the
reference; rerun this only to deliberately replace it (tests pin ids derived from it).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import re
import sys
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydoc_data.topics import topics as PYDOC_TOPICS

REPO_ROOT = Path(__file__).resolve().parents[1]

# Length bounds on one assistant answer, in characters. About 2.5 characters make one
# token of the 1024-token test tokenizer, so MIN_ANSWER_CHARS (~600 tokens) is above the
# 382-token answer window (the window's cut is exercised on real text), and
# MAX_ANSWER_CHARS keeps a conversation to a few thousand tokens.
MIN_ANSWER_CHARS = 1500
MAX_ANSWER_CHARS = 4000
# A first-turn answer in a two-exchange conversation may be short: it is context only.
MIN_FIRST_TURN_CHARS = 200
MAX_FIRST_TURN_CHARS = 1200
# Long sections are answered over at most this many assistant turns ("go on").
MAX_CONTINUATION_TURNS = 2
MAX_CONVERSATIONS_PER_PACKAGE = 10

# Every passage's key is hashed; its residues pick phrasings, system prompts, turns.
SYSTEM_PROMPT_ONE_IN = 3  # about a third of conversations carry a system prompt
FIRST_EXCHANGE_ONE_IN = 4  # about a quarter of single answers get a short first exchange

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a patient Python tutor. Explain things precisely and show the relevant syntax.",
    "You are a senior software engineer answering a colleague's question. Be thorough and exact.",
    "You are a documentation assistant. Stay close to the official documentation.",
    "Answer as an experienced technical writer would: clear structure, exact terms, no filler.",
)

TOPIC_QUESTIONS = (
    "How does {subject} work in Python?",
    "Can you explain {subject}?",
    "I'm reading the Python language reference. What does it say about {subject}?",
    "What are the exact rules for {subject} in Python?",
    "I keep getting confused by {subject}. Could you walk me through it?",
    "Please describe {subject} as the Python documentation does.",
    "What should I know about {subject}?",
)
CONTINUE_PROMPTS = (
    "Please go on.",
    "Thanks. What comes next?",
    "Continue, please; I want the rest of it.",
    "That helps. Is there more?",
    "Keep going.",
)
LATER_PART_QUESTIONS = (
    "I've read the first part of the reference on {subject}. What does the rest say?",
    "Picking up where the documentation on {subject} continues: what follows?",
)
MODULE_QUESTIONS = (
    "What is the `{name}` module in Python's standard library for?",
    "Give me an overview of Python's `{name}` module.",
    "I need to use `{name}`. What does it provide?",
    "What does the `{name}` module do?",
)
MODULE_SUMMARY_QUESTIONS = (
    "What is `{name}` in Python?",
    "Briefly, what is the `{name}` module?",
    "Quick question: what's `{name}` for?",
)
CLASS_QUESTIONS = (
    "How do I use `{name}`?",
    "What methods does `{name}` have?",
    "Can you document the `{name}` class for me?",
    "Explain `{name}` and its methods.",
)
FUNCTION_QUESTIONS = (
    "What does `{name}()` do?",
    "How do I call `{name}`? What are its arguments?",
    "Explain `{name}` with its parameters.",
    "Could you describe `{name}` in detail?",
)
PACKAGE_INTRO_QUESTIONS = (
    "What is the Python package {package}?",
    "What is {package} for, and why would I use it?",
    "Can you give me an overview of {package}?",
)
PACKAGE_SECTION_QUESTIONS = (
    "In {package}, what does the \u201c{heading}\u201d part of its documentation cover?",
    "Tell me about {heading} in {package}.",
    "Can you explain {heading} for the {package} library?",
    "I'm looking at {package}'s README. What does it say under \u201c{heading}\u201d?",
)

# Standard-library modules whose documentation is long and self-contained. A fixed list
# (rather than sys.stdlib_module_names) keeps the build free of import side effects.
STDLIB_MODULES = (
    "abc", "argparse", "ast", "asyncio.events", "asyncio.locks", "asyncio.queues", "asyncio.streams",
    "asyncio.tasks", "base64", "binascii", "bz2", "code", "codeop", "collections.abc", "contextvars", "dis",
    "email.utils", "filecmp", "fileinput", "fnmatch", "json.decoder", "json.encoder", "logging.handlers",
    "mimetypes", "numbers", "plistlib", "pstats", "reprlib", "runpy", "sysconfig", "tomllib", "types",
    "unittest.mock", "zipimport", "asyncio.base_events", "asyncio.protocols", "asyncio.transports",
    "email.headerregistry", "email.policy", "http.cookiejar", "http.cookies", "importlib.abc",
    "logging.config", "multiprocessing.connection", "multiprocessing.managers", "unittest.case",
    "unittest.loader", "xml.sax.handler", "xml.sax.saxutils", "xmlrpc.client", "wsgiref.handlers",
    "zoneinfo", "bisect", "calendar", "cmath", "codecs", "collections",
    "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "doctest", "email.message", "enum", "fractions", "ftplib", "functools",
    "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client",
    "http.server", "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "locale", "logging",
    "lzma", "mailbox", "math", "multiprocessing.pool", "operator", "optparse", "os", "pathlib",
    "pdb", "pickle", "pickletools", "pprint", "profile", "queue", "random", "re", "sched",
    "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "sqlite3", "ssl", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "typing", "unittest",
    "urllib.parse", "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom",
    "xml.etree.ElementTree", "zipfile", "zlib",
)  # fmt: skip

# Package sections whose text is mostly names, links or legal text, not prose.
SKIPPED_SECTION_WORDS = (
    "license", "licence", "citation", "cite", "contributor", "sponsor", "changelog", "change log",
    "release", "history", "changes", "acknowledg", "authors", "funding", "badge", "star history",
    "code of conduct", "security", "support", "community", "backers", "thanks",
)  # fmt: skip
PERMISSIVE_LICENCE_WORDS = ("mit", "bsd", "apache", "psf", "python software foundation", "isc")
COPYLEFT_LICENCE_WORDS = ("gpl", "mpl", "mozilla", "eupl", "cddl", "epl")
OWN_DISTRIBUTIONS = ("occamy-mtp",)  # this project: its README is not sample text


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str


@dataclass(frozen=True)
class Conversation:
    key: str  # sort key and seed of every choice; e.g. "1-reference/for/0"
    turns: tuple[Turn, ...]
    source: str  # for SOURCES.md: "Python 3.11 documentation", "numpy 2.4.6 (BSD-3-Clause)", ...


def stable_hash(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def pick(options: tuple[str, ...], key: str, salt: str) -> str:
    return options[stable_hash(f"{salt}:{key}") % len(options)]


# ---------------------------------------------------------------------------- text


def clean_text(text: str) -> str:
    """Strip trailing spaces, collapse runs of blank lines, trim the ends."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def chunk_paragraphs(text: str, max_chars: int) -> list[str]:
    """Split at blank lines into chunks of at most max_chars (over-long paragraphs at lines)."""
    pieces: list[str] = []
    for paragraph in text.split("\n\n"):
        if not paragraph.strip():
            continue
        if len(paragraph) <= max_chars:
            pieces.append(paragraph)
            continue
        block = ""
        for line in paragraph.split("\n"):
            if block and len(block) + 1 + len(line) > max_chars:
                pieces.append(block)
                block = ""
            block = f"{block}\n{line}" if block else line[:max_chars]
        if block:
            pieces.append(block)
    # Aim at equal chunks (ceil(total / max_chars) of them) so that no chunk is a stub.
    total_chars = sum(len(piece) + 2 for piece in pieces)
    target_chars = total_chars / max(1, -(-total_chars // max_chars))
    chunks: list[str] = []
    current = ""
    for piece in pieces:
        if current and (len(current) >= target_chars or len(current) + 2 + len(piece) > max_chars):
            chunks.append(current)
            current = ""
        current = f"{current}\n\n{piece}" if current else piece
    if current:
        chunks.append(current)
    return chunks


def truncate_paragraphs(text: str, max_chars: int) -> str:
    """The leading whole paragraphs that fit in max_chars ("" for empty text)."""
    chunks = chunk_paragraphs(text, max_chars)
    return chunks[0] if chunks else ""


def first_paragraphs(text: str, max_chars: int) -> str:
    """The first paragraph, plus following ones while they fit: a short summary answer."""
    paragraphs = text.split("\n\n")
    summary = paragraphs[0][:max_chars]
    for paragraph in paragraphs[1:]:
        if len(summary) + 2 + len(paragraph) > max_chars:
            break
        summary = f"{summary}\n\n{paragraph}"
    return summary


def lower_first(subject: str) -> str:
    """'The "for" statement' -> 'the "for" statement'; keeps acronyms and names as they are."""
    first_word = subject.split(" ", 1)[0]
    if first_word[:1].isupper() and first_word[1:].islower():
        return subject[:1].lower() + subject[1:]
    return subject


# ---------------------------------------------------------------- language reference

UNDERLINE = re.compile(r"^([*=\-~^])\1{2,}$")


def reference_sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) pairs of one pydoc topic, headings being the underlined lines."""
    lines = text.split("\n")
    sections: list[tuple[str, list[str]]] = []
    heading, body = "", []
    i = 0
    while i < len(lines):
        is_heading = i + 1 < len(lines) and lines[i].strip() and UNDERLINE.match(lines[i + 1].strip())
        if is_heading and len(lines[i + 1].strip()) >= len(lines[i].strip()) - 1:
            if heading or any(line.strip() for line in body):
                sections.append((heading, body))
            heading, body = lines[i].strip(), []
            i += 2
            continue
        body.append(lines[i])
        i += 1
    sections.append((heading, body))
    return [(title, clean_text("\n".join(body))) for title, body in sections if clean_text("\n".join(body))]


def merge_short_sections(sections: list[tuple[str, str]], min_chars: int) -> list[tuple[str, str]]:
    """Join short sections into their successors so that each answer is long enough.

    A merged answer keeps the later headings as lines of their own, the way a person
    pasting a documentation section would.
    """
    merged: list[tuple[str, str]] = []
    for heading, body in sections:
        if merged and len(merged[-1][1]) < min_chars:
            merged[-1] = (merged[-1][0], join_section(merged[-1][1], heading, body))
        else:
            merged.append((heading, body))
    if len(merged) > 1 and len(merged[-1][1]) < min_chars:  # a short tail joins its predecessor
        heading, body = merged.pop()
        merged[-1] = (merged[-1][0], join_section(merged[-1][1], heading, body))
    return merged


def join_section(previous_body: str, heading: str, body: str) -> str:
    return f"{previous_body}\n\n{heading}\n\n{body}" if heading else f"{previous_body}\n\n{body}"


def reference_conversations() -> Iterator[Conversation]:
    """One conversation per section (long ones continued over two turns).

    A section too short for a full answer ("pass", "await") becomes the first exchange
    of a following conversation: a user asking two things in a row.
    """
    source = f"Python {sys.version_info.major}.{sys.version_info.minor} language reference (pydoc_data.topics, PSF licence)"
    short_turns: list[Turn] = []
    for topic in sorted(PYDOC_TOPICS):
        sections = merge_short_sections(reference_sections(PYDOC_TOPICS[topic]), MIN_ANSWER_CHARS)
        for section_index, (heading, body) in enumerate(sections):
            subject = lower_first(heading or topic)
            key = f"1-reference/{topic}/{section_index:02d}"
            if len(body) < MIN_ANSWER_CHARS:
                short_turns.append(Turn(pick(TOPIC_QUESTIONS, key, "question").format(subject=subject), body))
                continue
            chunks = chunk_paragraphs(body, MAX_ANSWER_CHARS)
            for group_start in range(0, len(chunks), MAX_CONTINUATION_TURNS):
                group = chunks[group_start : group_start + MAX_CONTINUATION_TURNS]
                group_key = f"{key}/{group_start:02d}"
                opening = TOPIC_QUESTIONS if group_start == 0 else LATER_PART_QUESTIONS
                turns = [short_turns.pop(0)] if short_turns else []  # at most one: conversations stay short
                turns.append(Turn(pick(opening, group_key, "question").format(subject=subject), group[0]))
                for turn_index, chunk in enumerate(group[1:], start=1):
                    turns.append(Turn(pick(CONTINUE_PROMPTS, f"{group_key}/{turn_index}", "continue"), chunk))
                yield Conversation(group_key, tuple(turns), source)


# ---------------------------------------------------------------- standard library


def documented_members(module: object) -> Iterator[tuple[str, object]]:
    """Public classes and functions defined by a module (or its C accelerator)."""
    module_name = module.__name__
    accelerator = "_" + module_name.rsplit(".", 1)[-1]
    for name in sorted(vars(module)):
        member = vars(module)[name]
        if name.startswith("_") or not (inspect.isclass(member) or inspect.isroutine(member)):
            continue
        defined_in = getattr(member, "__module__", None) or ""
        if defined_in == module_name or defined_in.rsplit(".", 1)[-1] == accelerator:
            yield name, member


MEMORY_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # default reprs in signatures differ per run


def signature_text(name: str, member: object) -> str:
    try:
        return MEMORY_ADDRESS.sub("", f"{name}{inspect.signature(member)}")
    except (TypeError, ValueError):
        return name


def class_answer(qualified_name: str, cls: type) -> str:
    """The class docstring, then each public method's signature and first paragraph."""
    parts = [clean_text(inspect.getdoc(cls) or "")]
    method_lines = []
    for name in sorted(vars(cls)):
        method = vars(cls)[name]
        if name.startswith("_") or not inspect.isroutine(method):
            continue
        doc = inspect.getdoc(method)
        if not doc:
            continue
        summary = textwrap.indent(first_paragraphs(clean_text(doc), MAX_FIRST_TURN_CHARS), "    ")
        method_lines.append(f"{signature_text(name, method)}\n{summary}")
    if method_lines:
        parts.append(f"Methods of `{qualified_name}`:\n\n" + "\n\n".join(method_lines))
    return truncate_paragraphs("\n\n".join(part for part in parts if part), MAX_ANSWER_CHARS)


def stdlib_conversations() -> Iterator[Conversation]:
    source = f"Python {sys.version_info.major}.{sys.version_info.minor} standard-library docstrings (PSF licence)"
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        module_doc = clean_text(inspect.getdoc(module) or "")
        if len(module_doc) >= MIN_ANSWER_CHARS:
            key = f"2-stdlib/{module_name}"
            question = pick(MODULE_QUESTIONS, key, "question").format(name=module_name)
            yield Conversation(key, (Turn(question, truncate_paragraphs(module_doc, MAX_ANSWER_CHARS)),), source)
        for name, member in documented_members(module):
            qualified_name = f"{module_name}.{name}"
            key = f"2-stdlib/{qualified_name}"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", DeprecationWarning)  # deprecated APIs are poor samples
                    if inspect.isclass(member):
                        answer = class_answer(qualified_name, member)
                        question = pick(CLASS_QUESTIONS, key, "question").format(name=qualified_name)
                    else:
                        doc = clean_text(inspect.getdoc(member) or "")
                        answer = truncate_paragraphs(f"`{signature_text(qualified_name, member)}`\n\n{doc}", MAX_ANSWER_CHARS)
                        question = pick(FUNCTION_QUESTIONS, key, "question").format(name=qualified_name)
            except DeprecationWarning:
                continue
            if len(answer) < MIN_ANSWER_CHARS:
                continue
            turns = (Turn(question, answer),)
            summary = first_paragraphs(module_doc, MAX_FIRST_TURN_CHARS)
            if len(summary) >= MIN_FIRST_TURN_CHARS and stable_hash(f"first:{key}") % FIRST_EXCHANGE_ONE_IN == 0:
                first = Turn(pick(MODULE_SUMMARY_QUESTIONS, key, "summary").format(name=module_name), summary)
                turns = (first, *turns)
            yield Conversation(key, turns, source)


# ---------------------------------------------------------------- installed packages

HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
HTML_TAG = re.compile(r"</?[A-Za-z][^>]*>")
MD_IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
MD_LINK = re.compile(r"\[([^\]]+)\]\([^)]*\)")
MD_LINK_DEFINITION = re.compile(r"^\s*\[[^\]]+\]:\s*\S+.*$", re.M)
RST_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_{1,2}")
RST_SUBSTITUTION = re.compile(r"\|[\w\s-]+\|_?")
RST_DIRECTIVE_BLOCK = re.compile(r"^\.\. [^\n]*(\n[ \t]+[^\n]*)*", re.M)
VERSION_HEADING = re.compile(r"^v?\d+(\.\d+)+\b")  # a changelog entry such as "2.0.0 (2024-01-01)"
MD_HEADING = re.compile(r"^(#{1,3})\s+(.+?)\s*#*\s*$")


def clean_markup(text: str) -> str:
    """Markdown/reST README -> readable text: no HTML, images, badges or link targets."""
    text = HTML_COMMENT.sub("", text)
    text = MD_IMAGE.sub("", text)
    text = MD_LINK.sub(r"\1", text)
    text = MD_LINK_DEFINITION.sub("", text)
    text = RST_DIRECTIVE_BLOCK.sub("", text)
    text = RST_LINK.sub(r"\1", text)
    text = RST_SUBSTITUTION.sub("", text)
    text = HTML_TAG.sub("", text)
    lines = [line for line in text.split("\n") if line.strip() not in {"|", "-", "*"}]
    return clean_text("\n".join(lines))


def markup_sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) pairs of a README in Markdown (#-headings) or reST (underlines)."""
    lines = text.split("\n")
    sections: list[tuple[str, list[str]]] = [("", [])]
    in_code = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            in_code = not in_code
        heading = None
        if not in_code:
            markdown = MD_HEADING.match(line)
            if markdown:
                heading = markdown.group(2)
            elif i + 1 < len(lines) and line.strip() and UNDERLINE.match(lines[i + 1].strip()):
                heading = line.strip()
                i += 1
            elif UNDERLINE.match(line.strip()) and i + 2 < len(lines) and UNDERLINE.match(lines[i + 2].strip()):
                heading = lines[i + 1].strip()  # reST over-and-under title
                i += 2
        if heading is not None:
            sections.append((heading.strip("*_` "), []))
        else:
            sections[-1][1].append(line)
        i += 1
    return [(heading, clean_markup("\n".join(body))) for heading, body in sections]


def licence_of(metadata: importlib.metadata.PackageMetadata) -> str:
    expression = metadata.get("License-Expression") or ""
    if expression:
        return expression
    classifiers = [c.split("::")[-1].strip() for c in metadata.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return "; ".join(classifiers)
    return (metadata.get("License") or "").split("\n", 1)[0].strip()


def is_permissive(licence: str) -> bool:
    lowered = licence.lower()
    return any(word in lowered for word in PERMISSIVE_LICENCE_WORDS) and not any(
        word in lowered for word in COPYLEFT_LICENCE_WORDS
    )


def package_conversations() -> Iterator[Conversation]:
    distributions = {}
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata["Name"]
        if name and name.lower() not in OWN_DISTRIBUTIONS:
            distributions.setdefault(name.lower(), distribution)  # first on sys.path wins, as import does
    for normalised_name in sorted(distributions):
        metadata = distributions[normalised_name].metadata
        package, licence = metadata["Name"], licence_of(metadata)
        description = metadata.get_payload() or metadata.get("Description") or ""
        if not is_permissive(licence) or not description.strip():
            continue
        source = f"{package} {metadata['Version']} package description ({licence})"
        sections = [
            (heading, body)
            for heading, body in markup_sections(description)
            if body and not any(word in heading.lower() for word in SKIPPED_SECTION_WORDS) and not VERSION_HEADING.match(heading)
        ]
        kept = 0
        for index, (heading, body) in enumerate(merge_short_sections(sections, MIN_ANSWER_CHARS)):
            answer = truncate_paragraphs(body, MAX_ANSWER_CHARS)
            if len(answer) < MIN_ANSWER_CHARS or kept == MAX_CONVERSATIONS_PER_PACKAGE:
                continue
            key = f"3-package/{normalised_name}/{index:02d}"
            if index == 0 or not heading or heading.lower() == package.lower():
                question = pick(PACKAGE_INTRO_QUESTIONS, key, "question").format(package=package)
            else:
                question = pick(PACKAGE_SECTION_QUESTIONS, key, "question").format(package=package, heading=heading)
            kept += 1
            yield Conversation(key, (Turn(question, answer),), source)


# ---------------------------------------------------------------- output


def to_record(conversation: Conversation) -> dict[str, list[dict[str, str]]]:
    """OpenAI-style messages; a system prompt on about one conversation in three."""
    messages = []
    key_hash = stable_hash(f"system:{conversation.key}")
    if key_hash % SYSTEM_PROMPT_ONE_IN == 0:
        messages.append({"role": "system", "content": pick(SYSTEM_PROMPTS, conversation.key, "system")})
    for turn in conversation.turns:
        messages.append({"role": "user", "content": turn.question})
        messages.append({"role": "assistant", "content": turn.answer})
    return {"messages": messages}


def build(out_path: Path, sources_path: Path) -> list[Conversation]:
    conversations = [*reference_conversations(), *stdlib_conversations(), *package_conversations()]
    conversations.sort(key=lambda conversation: conversation.key)
    keys = [conversation.key for conversation in conversations]
    if len(set(keys)) != len(keys):
        raise RuntimeError("duplicate conversation keys")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", encoding="utf-8", newline="\n") as out:
        for conversation in conversations:
            out.write(json.dumps(to_record(conversation), ensure_ascii=False) + "\n")

    counts: dict[str, int] = {}
    for conversation in conversations:
        counts[conversation.source] = counts.get(conversation.source, 0) + 1
    lines = [
        "# Sources of data/sample.jsonl",
        "",
        "Generated by scripts/build_sample_data.py; one line per source: conversations, then source and licence.",
        "",
    ]
    lines += [f"- {count:4d}  {source}" for source, count in sorted(counts.items())]
    sources_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return conversations


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "sample.jsonl")
    parser.add_argument("--sources", type=Path, default=REPO_ROOT / "data" / "SOURCES.md")
    args = parser.parse_args(argv)
    conversations = build(args.out, args.sources)
    multi_turn = sum(len(conversation.turns) > 1 for conversation in conversations)
    size_mb = args.out.stat().st_size / 1e6
    print(f"wrote {len(conversations)} conversations ({multi_turn} multi-turn, {size_mb:.2f} MB) to {args.out}")


if __name__ == "__main__":
    main()
