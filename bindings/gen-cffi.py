#!/usr/bin/env python3
"""Generate the CFFI cdef of the Python binding from the public C header.

The header `abi/include/kvh/kvh.h` is the single source of the binding: this
script preprocesses it (X-macros expanded, includes, comments, `KVH_API` and
attributes removed), keeps the integer `#define`s that name versions and
counts, normalises the layout so that the output does not depend on the
compiler's spacing, and writes `python/kvh_cache/_cdef.h` (committed).

    python3 bindings/gen-cffi.py            # regenerate python/kvh_cache/_cdef.h
    python3 bindings/gen-cffi.py --check    # exit 1 if the committed file drifted
    python3 bindings/gen-cffi.py --stdout   # print the cdef

Needs a C preprocessor (`$CC`, else `cc`/`gcc`, run as `CC -E -P`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "abi" / "include" / "kvh" / "kvh.h"
OUTPUT = ROOT / "python" / "kvh_cache" / "_cdef.h"

# Object-like integer macros that the binding exposes as constants.
KEEP_DEFINE = re.compile(r"^\s*#\s*define\s+(KVH_[A-Z0-9_]+)\s+(-?(?:0x[0-9A-Fa-f]+|\d+)[uUlL]*)\s*(?:/[*/].*)?$")


def find_cpp() -> list[str]:
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    raise SystemExit("gen-cffi: no C compiler found (set CC) to preprocess the header")


def kept_defines(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        m = KEEP_DEFINE.match(line)
        if m:
            value = m.group(2).rstrip("uUlL")
            out.append(f"#define {m.group(1)} {value}")
    return out


def preprocess(text: str) -> str:
    # Drop #include lines: cffi knows size_t and the <stdint.h> types, and the
    # system headers' declarations must not enter the cdef.
    body = "\n".join(line for line in text.splitlines() if not re.match(r"^\s*#\s*include\b", line))
    # KVH_API expands to an attribute under GCC; defining it empty first and
    # -undef (no __GNUC__) keep the declarations plain on any compiler.
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kvh_cdef_input.h"
        src.write_text(body)
        cmd = find_cpp() + ["-E", "-P", "-undef", "-x", "c", str(src)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"gen-cffi: preprocessing failed ({' '.join(cmd)}):\n{res.stderr}")
        return res.stdout


def normalise(code: str) -> str:
    """One declaration (or struct/enum member) per line, fixed spacing."""
    code = re.sub(r"__attribute__\s*\(\(.*?\)\)", "", code)
    code = re.sub(r"\bKVH_API\b", "", code)
    code = re.sub(r'extern\s+"C"\s*\{', "", code)
    tokens = re.findall(r'"(?:\\.|[^"\\])*"|[A-Za-z_]\w*|\d\w*|\.\.\.|->|[^\s\w]', code)
    lines: list[str] = []
    cur: list[str] = []
    depth = 0
    paren = 0

    def flush() -> None:
        if cur:
            lines.append("    " * depth + join(cur))
            cur.clear()

    for tok in tokens:
        if tok == "(":
            paren += 1
        elif tok == ")":
            paren -= 1
        if tok == "{" and paren == 0:
            cur.append("{")
            flush()
            depth += 1
            continue
        if tok == "}" and paren == 0:
            flush()
            depth -= 1
            cur.append("}")
            continue
        cur.append(tok)
        if paren == 0 and (tok == ";" or (tok == "," and depth > 0 and _in_enum(lines))):
            flush()
    flush()
    return "\n".join(lines) + "\n"


def _in_enum(lines: list[str]) -> bool:
    # The innermost open brace belongs to an enum when the line that opened it
    # starts with "enum" (or "typedef enum").
    opened = 0
    for line in reversed(lines):
        s = line.strip()
        if s.startswith("}"):
            opened -= 1
        elif s.endswith("{"):
            if opened == 0:
                return bool(re.match(r"^(typedef\s+)?enum\b", s))
            opened += 1
    return False


def join(tokens: list[str]) -> str:
    """Joins tokens with C-style spacing (`int *p`, `f(void)`, `(*fn)(...)`)."""
    out = ""
    for i, tok in enumerate(tokens):
        prev = tokens[i - 1] if i else ""
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if not out:
            out = tok
            continue
        glue = (
            tok in (",", ";", ")", "]", "[")
            or prev in ("(", "[")
            or prev == "*"
            or (tok == "*" and prev == "*")
            or (tok == "(" and re.match(r"\w", prev) and nxt != "*")
            or (tok == "(" and prev == ")")
            or (re.match(r"\d", tok) and prev == "-" and i >= 2 and tokens[i - 2] in ("=", "(", ",", "["))
        )
        out += tok if glue else " " + tok
    return out


def generate() -> str:
    text = HEADER.read_text()
    defines = kept_defines(text)
    body = normalise(preprocess(text))
    rel = HEADER.relative_to(ROOT).as_posix()
    head = [
        f"/* Generated by bindings/gen-cffi.py from {rel}. Do not edit: run",
        " * `python3 bindings/gen-cffi.py` after changing the header. */",
    ]
    return "\n".join(head + defines) + "\n" + body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="exit 1 if the committed cdef differs from the header")
    g.add_argument("--stdout", action="store_true", help="print the cdef instead of writing it")
    ap.add_argument(
        "--output", type=Path, default=OUTPUT, help=f"file to write or check (default {OUTPUT.relative_to(ROOT)})"
    )
    args = ap.parse_args(argv)
    new = generate()
    if args.stdout:
        sys.stdout.write(new)
        return 0
    if args.check:
        old = args.output.read_text() if args.output.exists() else ""
        if old == new:
            print(f"gen-cffi: {args.output} is up to date with {HEADER.relative_to(ROOT)}")
            return 0
        diff = difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(args.output), "regenerated")
        sys.stdout.writelines(diff)
        print(f"gen-cffi: {args.output} drifted from the header; run python3 bindings/gen-cffi.py", file=sys.stderr)
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if not args.output.exists() or args.output.read_text() != new:
        args.output.write_text(new)
        print(f"gen-cffi: wrote {args.output}")
    else:
        print(f"gen-cffi: {args.output} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
