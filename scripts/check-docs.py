#!/usr/bin/env python3
"""Checks the documentation tree, quickly and without the network.

1. docs/code-map.md names every file under src/, tests/,
   fuzz/fuzz_targets/, scripts/, xtask/src and every bench/*.py, as a
   path in backquotes (`src/conn/mod.rs`), and every such path it names
   exists.
2. Every relative link in README.md and docs/**/*.md leads to a file or
   directory that exists, and every #anchor to a heading of the Markdown
   file it names, with GitHub's anchors (lower case, punctuation dropped,
   spaces made hyphens, -1, -2 for repeats).

    scripts/check-docs.py              # check the repository
    scripts/check-docs.py --self-test  # the checker's own tests

Exit status 0 when all is well; 1 with one line per problem otherwise.
"""

import os
import re
import sys
import tempfile
import unittest
from urllib.parse import unquote

CODE_MAP = "docs/code-map.md"
# What the code map must name: (directory, file name suffix, recurse).
MAPPED = [
    ("src", "", True),
    ("tests", "", True),
    ("fuzz/fuzz_targets", "", True),
    ("bench", ".py", False),
    ("scripts", "", True),
    ("xtask/src", "", True),
]
# A backquoted word starting so is taken for a path the map names.
PATH_ROOTS = ("src/", "tests/", "fuzz/", "bench/", "scripts/", "xtask/",
              "deploy/", "docs/", "certs/", ".ci/")
IGNORED_DIRS = {"__pycache__", "target", ".git"}

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def prose_lines(text):
    """The lines outside fenced code blocks, with their numbers."""
    fenced = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fenced is None:
                fenced = match.group(1)
            elif fenced == match.group(1):
                fenced = None
            continue
        if fenced is None:
            yield number, line


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def anchors(text):
    """Every anchor a Markdown file has."""
    seen = {}
    found = set()
    for _, line in prose_lines(text):
        found.update(HTML_ID.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def paragraphs(text):
    """(first line number, text) of each run of prose lines, joined, so
    that a link wrapped across lines is still one link."""
    start, joined, last = None, [], None
    for number, line in prose_lines(text):
        if line.strip() and last is not None and number == last + 1 and joined:
            joined.append(line.strip())
        else:
            if joined:
                yield start, " ".join(joined)
            start, joined = number, [line.strip()] if line.strip() else []
        last = number
    if joined:
        yield start, " ".join(joined)


def links(text):
    """(line number, target) of every link outside code."""
    for _, line in prose_lines(text):
        match = REFERENCE_LINK.match(line)
        if match:
            yield _, match.group(1)
    for number, paragraph in paragraphs(text):
        paragraph = CODE_SPAN.sub("", paragraph)
        for target in INLINE_LINK.findall(paragraph):
            yield number, target


def markdown_files(root):
    files = [os.path.join(root, "README.md")]
    for base, dirs, names in os.walk(os.path.join(root, "docs")):
        dirs[:] = sorted(d for d in dirs if d not in IGNORED_DIRS)
        files += [os.path.join(base, n) for n in sorted(names) if n.endswith(".md")]
    return [f for f in files if os.path.isfile(f)]


def check_links(root):
    problems = []
    cache = {}
    real_root = os.path.realpath(root)
    for path in markdown_files(root):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        where = os.path.relpath(path, root)
        for number, target in links(text):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                continue  # http:, https:, mailto:: not checked offline
            file_part, _, anchor = target.partition("#")
            dest = path if not file_part else os.path.normpath(
                os.path.join(os.path.dirname(path), unquote(file_part)))
            if not os.path.realpath(dest).startswith(real_root + os.sep):
                problems.append(f"{where}:{number}: {target}: outside the repository")
                continue
            if not os.path.exists(dest):
                problems.append(f"{where}:{number}: {target}: no such file")
                continue
            if not anchor:
                continue
            if not dest.endswith(".md") or os.path.isdir(dest):
                problems.append(f"{where}:{number}: {target}: an anchor into a non-Markdown file")
                continue
            if dest not in cache:
                with open(dest, encoding="utf-8") as f:
                    cache[dest] = anchors(f.read())
            if unquote(anchor) not in cache[dest]:
                problems.append(f"{where}:{number}: {target}: no heading with anchor #{anchor}")
    return problems


def mapped_files(root):
    """Every file the code map must name, relative to root."""
    out = set()
    for directory, suffix, recurse in MAPPED:
        top = os.path.join(root, directory)
        for base, dirs, names in os.walk(top):
            dirs[:] = [d for d in dirs if d not in IGNORED_DIRS]
            if not recurse:
                dirs[:] = []
            for name in names:
                if name.endswith(suffix) and not name.endswith(".pyc"):
                    out.add(os.path.relpath(os.path.join(base, name), root))
    return out


def named_paths(text):
    """(line number, path) of every backquoted path the code map names."""
    for number, line in prose_lines(text):
        for _, word in CODE_SPAN.findall(line):
            word = word.strip()
            if word.startswith(PATH_ROOTS) and not re.search(r"[\s*]", word):
                yield number, word


def check_code_map(root):
    path = os.path.join(root, CODE_MAP)
    if not os.path.isfile(path):
        return [f"{CODE_MAP}: missing"]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    problems = []
    named = set()
    for number, word in named_paths(text):
        named.add(word.rstrip("/"))
        if not os.path.exists(os.path.join(root, word)):
            problems.append(f"{CODE_MAP}:{number}: `{word}`: no such file or directory")
    for missing in sorted(mapped_files(root) - named):
        problems.append(f"{CODE_MAP}: does not name {missing}")
    return problems


def main(argv):
    if argv[1:] == ["--self-test"]:
        sys.argv = argv[:1]
        unittest.main(module=__name__, verbosity=1)
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(argv[0])), ".."))
    problems = check_code_map(root) + check_links(root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"check-docs: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("check-docs: the code map names every file, and every link resolves")
    return 0


class SelfTest(unittest.TestCase):
    def tree(self, files):
        root = tempfile.mkdtemp(prefix="check-docs-")
        self.addCleanup(lambda: __import__("shutil").rmtree(root))
        for name, text in files.items():
            path = os.path.join(root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return root

    def test_github_anchors(self):
        self.assertEqual(slug("Who may put sockets in --export-dir"),
                         "who-may-put-sockets-in---export-dir")
        self.assertEqual(slug("Surviving server restarts: `--reconnect`"),
                         "surviving-server-restarts---reconnect")
        self.assertEqual(slug("`nbdgw policy check`"), "nbdgw-policy-check")
        self.assertEqual(slug("Tenants: the threat model"), "tenants-the-threat-model")
        self.assertEqual(anchors("# A\n## A\n```\n# B\n```\n"), {"a", "a-1"})

    def test_links_outside_code_only(self):
        text = ("see [x](a.md#b) and `[y](c.md)`\n```\n[z](d.md)\n```\n[r]: e.md\n"
                "a [wrapped\nlink](f.md) and `a wrapped\ncode [span](g.md)`\n")
        self.assertEqual(sorted(t for _, t in links(text)), ["a.md#b", "e.md", "f.md"])

    def test_broken_links_and_anchors_are_found(self):
        root = self.tree({
            "README.md": "[ok](docs/a.md#two-words) [gone](docs/b.md) [bad](docs/a.md#nope)\n"
                         "[self](#title) [web](https://example.org/x) [dir](docs/)\n# Title\n",
            "docs/a.md": "## Two words\n[up](../README.md#title) [out](../../x.md)\n",
        })
        problems = check_links(root)
        self.assertEqual(len(problems), 3, problems)
        self.assertIn("docs/b.md: no such file", problems[0])
        self.assertIn("#nope", problems[1])
        self.assertIn("outside the repository", problems[2])

    def test_code_map_names_every_file_and_nothing_else(self):
        root = self.tree({
            "src/main.rs": "", "src/conn/mod.rs": "", "bench/run.py": "",
            "bench/RESULTS.md": "", "scripts/test.sh": "", "tests/a.rs": "",
            "xtask/src/main.rs": "", "fuzz/fuzz_targets/t.rs": "",
            CODE_MAP: "- `src/main.rs` `src/conn/` `bench/run.py` `scripts/test.sh`\n"
                      "- `xtask/src/main.rs` `fuzz/fuzz_targets/t.rs` `src/gone.rs`\n"
                      "```\n`tests/a.rs`\n```\n",
        })
        problems = check_code_map(root)
        self.assertEqual(problems, [
            f"{CODE_MAP}:2: `src/gone.rs`: no such file or directory",
            f"{CODE_MAP}: does not name src/conn/mod.rs",
            f"{CODE_MAP}: does not name tests/a.rs",
        ])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
