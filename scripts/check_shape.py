#!/usr/bin/env python3
"""The code's shape, checked in CI: no import circle between the crate's
modules, no function over 60 lines, no `impl` block over 300 lines, one
module style (a module with submodules is `name/mod.rs`, never `name.rs`
beside `name/`), and no two source files of one name unless the name is
a role every module may have (`SHARED_NAMES`).

Rust is read with a small lexer that knows strings, raw strings, chars,
lifetimes and comments, so a brace inside a string or a comment does not
count. A function is measured from its `fn` line to its closing brace;
a closure or a macro body inside it counts toward it, so length cannot be
hidden there.

Offenders known when the check was written (and the import circles, as
`circle a b c 3`) are listed in
scripts/shape-allow.txt with the length they had: they may shrink, never
grow, and a listed one that is gone or fits must be removed from the list
(so the list only ever gets shorter).

    scripts/check_shape.py            # check src/ (exit 1 on a finding)
    scripts/check_shape.py --report   # every function and impl over the limits
    scripts/check_shape.py --self-test
"""
import os
import re
import sys

FN_LIMIT = 60
IMPL_LIMIT = 300
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ALLOW = os.path.join(ROOT, "scripts", "shape-allow.txt")
# Names that say a file's role inside its module, not what it does: a
# module's root, its tests, its settings, and the request and reply halves of a relay
# (the transmission relay, the read cache's layer, client mode's
# reconnecting stream each have both).
SHARED_NAMES = {"mod.rs", "tests.rs", "settings.rs", "requests.rs", "replies.rs"}


def layout_problems(src):
    """Mixed module styles and file names used twice for different things."""
    problems, seen = [], {}
    for path in rust_files(src):
        rel = os.path.relpath(path, ROOT)
        base = os.path.basename(path)
        if base != "mod.rs" and os.path.isdir(path[:-3]):
            problems.append(f"{rel}: beside {rel[:-3]}/; move it to {rel[:-3]}/mod.rs")
        if base in ("lib.rs", "main.rs") and os.path.dirname(path) == src:
            continue
        seen.setdefault(base, []).append(rel)
    for base, paths in sorted(seen.items()):
        if len(paths) > 1 and base not in SHARED_NAMES:
            problems.append(f"two files named {base}: " + ", ".join(sorted(paths)) + " (rename one for what it does)")
    return problems


def blank_out(text):
    """The text with every string, char literal and comment replaced by
    spaces (newlines kept), so that braces and words in them vanish."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif (m := re.match(r'(b?r)(#*)"', text[i:i + 300])) and (
            i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")
        ):
            end = '"' + m.group(2)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'":
            # A char literal ('x', '\n', '\u{1F600}', '{') or a lifetime ('a).
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:i + 12])
            if m:
                out.append(" " * m.end())
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


FN_RE = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")
IMPL_RE = re.compile(r"^[ \t]*(?:unsafe\s+)?impl\b")


def blocks(text):
    """(kind, name, first line, line count) for every fn with a body and
    every impl block."""
    clean = blank_out(text)
    line_of = []
    line = 1
    for ch in clean:
        line_of.append(line)
        if ch == "\n":
            line += 1
    found = []
    for kind, regex in (("fn", FN_RE), ("impl", IMPL_RE)):
        flags = re.MULTILINE if kind == "impl" else 0
        for m in re.compile(regex.pattern, flags).finditer(clean):
            start = m.start()
            # The body's brace comes before any `;` (a declaration has none).
            j, depth_paren = m.end(), 0
            while j < len(clean):
                ch = clean[j]
                if ch in "([<" and kind == "fn":
                    depth_paren += ch != "<"
                elif ch in ")]":
                    depth_paren -= 1
                elif ch == ";" and depth_paren <= 0:
                    j = -1
                    break
                elif ch == "{" and depth_paren <= 0:
                    break
                j += 1
            if j < 0 or j >= len(clean):
                continue
            depth, k = 0, j
            while k < len(clean):
                if clean[k] == "{":
                    depth += 1
                elif clean[k] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                k += 1
            name = m.group(1) if kind == "fn" else " ".join(
                clean[start:j].split())[:80]
            first, last = line_of[start], line_of[min(k, len(clean) - 1)]
            found.append((kind, name, first, last - first + 1))
    return found


def rust_files(top):
    for base, dirs, files in os.walk(top):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".rs"):
                yield os.path.join(base, f)


def module_of(path, src):
    """The top-level module a file under src/ belongs to (`conn` for
    src/conn/relay/mod.rs), or None for lib.rs and main.rs."""
    rel = os.path.relpath(path, src).replace(os.sep, "/")
    head = rel.split("/")[0]
    if head in ("lib.rs", "main.rs"):
        return None
    return head[:-3] if head.endswith(".rs") else head


def edges(src):
    """Top-level module -> the crate's top-level modules it names."""
    graph = {}
    for path in rust_files(src):
        mod = module_of(path, src)
        if mod is None:
            continue
        clean = blank_out(open(path, encoding="utf-8").read())
        # Tests may reach anywhere: only code outside #[cfg(test)] counts.
        cut = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", clean)
        if cut:
            clean = clean[:cut.start()]
        targets = graph.setdefault(mod, set())
        for m in re.finditer(r"\bcrate::(\w+)", clean):
            targets.add(m.group(1))
        for m in re.finditer(r"\buse\s+crate::\{([^}]*)\}", clean):
            for part in m.group(1).split(","):
                word = part.strip().split("::")[0].strip()
                if word:
                    targets.add(word)
        targets.discard(mod)
    mods = set(graph)
    return {m: {t for t in ts if t in mods} for m, ts in graph.items()}


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def offenders(src):
    found = {}
    for path in rust_files(src):
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        for kind, name, first, length in blocks(open(path, encoding="utf-8").read()):
            limit = FN_LIMIT if kind == "fn" else IMPL_LIMIT
            if length > limit:
                key = f"{rel} {kind} {name}" if kind == "fn" else f"{rel} impl@{first}"
                if kind == "impl":
                    key = f"{rel} impl {name}"
                found[key] = max(length, found.get(key, 0))
    return found


def read_allow():
    allow = {}
    if os.path.exists(ALLOW):
        for raw in open(ALLOW, encoding="utf-8"):
            line = raw.split("#", 1)[0].rstrip()
            if line:
                key, _, length = line.rpartition(" ")
                allow[key] = int(length)
    return allow


def check(src):
    problems = []
    found, allow = offenders(src), read_allow()
    circles = {"circle " + " ".join(comp): len(comp) for comp in cycles(edges(src))}
    for key, size in circles.items():
        if key not in allow:
            problems.append(f"import circle between modules: {key[7:]}")
    found.update(circles)
    for key, length in sorted(found.items()):
        if key.startswith("circle "):
            continue
        kind = "impl" if " impl " in key else "fn"
        limit = IMPL_LIMIT if kind == "impl" else FN_LIMIT
        if key not in allow:
            problems.append(f"{key}: {length} lines (limit {limit})")
        elif length > allow[key]:
            problems.append(f"{key}: grew to {length} lines (allowed {allow[key]}, limit {limit})")
    for key in sorted(set(allow) - set(found)):
        problems.append(f"{key}: fits now (or is gone): remove it from scripts/shape-allow.txt")
    return problems + layout_problems(src)


SELF_TEST = r'''
impl A {
    fn short() { let s = "}}}}"; let c = '}'; let r = r#"{"#; }
    // fn commented() {
    fn long<'a>(x: &'a str) -> Vec<u8> where u8: Copy {
        /* { nested /* } */ */
        XLINES
    }
    fn declared(&self);
}
'''


def self_test():
    text = SELF_TEST.replace("XLINES", "\n".join("let _ = 1;" for _ in range(70)))
    got = {(k, n): length for k, n, _, length in blocks(text)}
    assert got[("fn", "short")] == 1, got
    assert got[("fn", "long")] == 73, got
    assert ("fn", "declared") not in got and ("fn", "commented") not in got, got
    assert list(got.get(k) for k in got if k[0] == "impl") == [78], got
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    print("check_shape self-test: ok")


def main():
    src = os.path.join(ROOT, "src")
    if "--self-test" in sys.argv:
        self_test()
        return 0
    if "--report" in sys.argv:
        for key, length in sorted(offenders(src).items(), key=lambda kv: -kv[1]):
            print(f"{key} {length}")
        for comp in cycles(edges(src)):
            print("circle " + " ".join(comp) + f" {len(comp)}")
        return 0
    problems = check(src)
    for p in problems:
        print("shape: " + p, file=sys.stderr)
    if not problems:
        print("shape: no import circle; every function and impl within its limit or allowed; one module style; no file name used twice")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
