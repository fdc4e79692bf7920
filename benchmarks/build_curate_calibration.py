"""Build the curation calibration set from human-written text on this machine; prints one JSON line.

    python benchmarks/build_curate_calibration.py [--out posttrain/curate/calibration/real_text.jsonl.gz]

The set is a few hundred clean chat records ``{"id", "prompt", "response", "meta"}``: a question
about a topic (a fixed template, picked by a hash of the record id) and, as the answer, real text
that nobody here wrote or generated:

- ``python-reference``: the language-reference topics shipped with CPython (``pydoc_data.topics``,
  what ``help("assert")`` prints), cut into answer-sized chunks of whole paragraphs;
- ``python-docstring``: docstrings of public functions and classes of a fixed list of stdlib modules;
- ``debian-description``: long descriptions of the Debian packages installed here (``dpkg-query``),
  with the licence named in each package's ``/usr/share/doc/<package>/copyright``.

Hard-wrapped prose lines are joined (a chat answer is not wrapped at 72 columns); indented code and
list lines keep their line breaks. Texts that repeat each other are left out at build time with a
check independent of the curation code (``difflib`` ratio ≥ 0.5 of the word sequences against any earlier response), so
the set holds distinct records and any duplicate the curation stage reports among them is a false
positive. The output is deterministic for a given Python and package set; it is vendored, so the
calibration figures do not depend on the Python or the packages of the machine that runs them.
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import hashlib
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "posttrain" / "curate" / "calibration" / "real_text.jsonl.gz"

STDLIB_MODULES = (
    "argparse", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "difflib", "enum", "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib", "heapq",
    "hmac", "html", "inspect", "ipaddress", "itertools", "json", "logging", "math", "operator", "os",
    "os.path", "pathlib", "pprint", "queue", "random", "re", "secrets", "shlex", "shutil", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing", "urllib.parse",
    "uuid", "zipfile", "zlib",
)  # fmt: skip

PROMPTS = {
    "python-reference": (
        "Explain {subject} in Python.",
        "How does {subject} work in Python?",
        "What does the Python language reference say about {subject}?",
        "Can you describe {subject} in Python for me?",
        "I'm reading about {subject} in Python. What should I know?",
    ),
    "python-docstring": (
        "What does {subject} do in Python?",
        "Explain the Python function or class {subject}.",
        "How do I use {subject}?",
        "What is {subject} in the Python standard library?",
    ),
    "debian-description": (
        "What is the Debian package {subject}?",
        "What does the {subject} package provide?",
        "Tell me about the {subject} package.",
        "What is {subject} for?",
    ),
}

MIN_WORDS, MAX_WORDS = 12, 250
_HEADING_RULE = re.compile(r"^[*=\-~^]{3,}$")


def reflow(paragraph: str) -> str:
    """Join hard-wrapped prose lines; a paragraph with indented or bulleted lines keeps its breaks."""
    lines = paragraph.split("\n")
    structured = any(re.match(r"^(\s{2,}|\s*[-*•]\s|\s*\d+[.)]\s|>>>)", line) for line in lines[1:])
    if structured or paragraph.lstrip().startswith(">>>"):
        return paragraph.rstrip()
    return " ".join(line.strip() for line in lines if line.strip())


def chunks(paragraphs: list[str], max_words: int = 160) -> list[str]:
    """Consecutive paragraphs grouped into chunks of at most ``max_words`` words (a longer paragraph alone)."""
    out: list[str] = []
    current: list[str] = []
    size = 0
    for paragraph in paragraphs:
        n = len(paragraph.split())
        if current and size + n > max_words:
            out.append("\n\n".join(current))
            current, size = [], 0
        current.append(paragraph)
        size += n
    if current:
        out.append("\n\n".join(current))
    return out


def python_reference() -> list[dict]:
    import pydoc_data.topics

    records = []
    for topic in sorted(pydoc_data.topics.topics):
        text = pydoc_data.topics.topics[topic].replace("\r\n", "\n")
        lines = text.split("\n")
        heading, sections, body = topic, [], []
        for position, line in enumerate(lines):
            following = lines[position + 1] if position + 1 < len(lines) else ""
            if _HEADING_RULE.match(following.strip()) and line.strip():
                if body:
                    sections.append((heading, body))
                heading, body = line.strip(), []
            elif not _HEADING_RULE.match(line.strip()):
                body.append(line)
        if body:
            sections.append((heading, body))
        for number, (title, section) in enumerate(sections):
            paragraphs = [reflow(p) for p in re.split(r"\n\s*\n", "\n".join(section)) if p.strip()]
            for part, chunk in enumerate(chunks(paragraphs)):
                subject = title.replace('"', "").strip().rstrip(":") or topic
                records.append(_record("python-reference", f"{topic}/{number}/{part}", subject, chunk,
                                       f"pydoc_data.topics[{topic!r}]", "PSF-2.0"))  # fmt: skip
    return records


def python_docstrings() -> list[dict]:
    records = []
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(getattr(module, "__all__", None) or dir(module)):
            obj = getattr(module, name, None)
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            if (getattr(obj, "__module__", None) or "").split(".")[0] != module.__name__.split(".")[0]:
                continue  # re-exported from elsewhere: documented under its own module
            doc = inspect.getdoc(obj)
            if not doc or doc.startswith(("Initialize self", "Create and return a new object")):
                continue
            paragraphs = [reflow(p) for p in re.split(r"\n\s*\n", doc) if p.strip()]
            records.append(_record("python-docstring", f"{module_name}.{name}", f"{module_name}.{name}",
                                   chunks(paragraphs)[0], f"{module_name}.{name}.__doc__", "PSF-2.0"))  # fmt: skip
    return records


def debian_licence(package: str) -> str:
    path = Path("/usr/share/doc", package, "copyright")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"no /usr/share/doc/{package}/copyright on the build machine"
    found = re.search(r"^License:\s*(\S.*)$", text, re.M)
    return found.group(1).strip() if found else f"see /usr/share/doc/{package}/copyright"


def debian_descriptions() -> list[dict]:
    listing = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\t${Version}\t${Description}\n\x1e"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    records = []
    for entry in sorted(e.strip("\n") for e in listing.split("\x1e") if e.strip()):
        package, version, description = entry.split("\t", 2)
        long_lines = [line[1:] if line.startswith(" ") else line for line in description.split("\n")[1:]]
        paragraphs = [reflow(p) for p in "\n".join(long_lines).split("\n.\n") if p.strip() and p.strip() != "."]
        if not paragraphs:
            continue
        text = "\n\n".join(paragraphs)
        records.append(_record("debian-description", package, package, text,
                               f"dpkg {package} {version}", debian_licence(package)))  # fmt: skip
    return records


def _record(source: str, key: str, subject: str, response: str, origin: str, licence: str) -> dict:
    record_id = f"{source}:{key}"
    templates = PROMPTS[source]
    choice = int(hashlib.sha256(record_id.encode()).hexdigest(), 16) % len(templates)
    return {
        "id": record_id,
        "prompt": templates[choice].format(subject=subject),
        "response": response.strip(),
        "meta": {"source": source, "origin": origin, "licence": licence},
    }


def distinct(records: list[dict], max_ratio: float = 0.5) -> list[dict]:
    """Records whose response is not too close (``difflib`` ratio) to any kept earlier one."""
    kept: list[dict] = []
    matchers: list[difflib.SequenceMatcher] = []  # seq2 = a kept response (difflib caches seq2)
    for record in records:
        text = record["response"].lower().split()  # word sequences: character bags of English all look alike
        similar = False
        for matcher in matchers:
            matcher.set_seq1(text)
            if matcher.real_quick_ratio() >= max_ratio and matcher.quick_ratio() >= max_ratio and matcher.ratio() >= max_ratio:
                similar = True
                break
        if not similar:
            matchers.append(difflib.SequenceMatcher(None, [], text, autojunk=False))
            kept.append(record)
    return kept


def pick(records: list[dict], count: int) -> list[dict]:
    """``count`` records in a fixed pseudo-random order (by hash of the id), answer-sized ones only."""
    sized = [r for r in records if MIN_WORDS <= len(r["response"].split()) <= MAX_WORDS]
    sized.sort(key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest())
    return sized[:count]


def build(counts: dict[str, int]) -> list[dict]:
    by_source = {
        "python-reference": python_reference(),
        "python-docstring": python_docstrings(),
        "debian-description": debian_descriptions(),
    }
    candidates = []
    for source, records in by_source.items():
        candidates += pick(records, counts[source] * 2)  # twice as many: some are left out as too similar
    chosen = distinct(candidates)
    out = []
    for source in by_source:
        out += [r for r in chosen if r["meta"]["source"] == source][: counts[source]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--reference", type=int, default=260)
    parser.add_argument("--docstrings", type=int, default=200)
    parser.add_argument("--debian", type=int, default=200)
    args = parser.parse_args()
    counts = {"python-reference": args.reference, "python-docstring": args.docstrings, "debian-description": args.debian}
    records = build(counts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode("utf-8")
    with open(args.out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as handle:
        handle.write(payload)  # mtime=0 and no name: the same records give the same bytes
    per_source = {s: sum(r["meta"]["source"] == s for r in records) for s in counts}
    print(json.dumps({"benchmark": "build_curate_calibration", "records": len(records), "per_source": per_source,
                      "bytes": args.out.stat().st_size, "sha256_jsonl": hashlib.sha256(payload).hexdigest(),
                      "python": sys.version.split()[0], "out": str(args.out)}))  # fmt: skip


if __name__ == "__main__":
    main()
