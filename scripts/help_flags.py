#!/usr/bin/env python3
"""Every flag of every nbdgw command, normalized from `--help`: one line
per flag with its value name, variable, default, possible values and help
text, sorted, so that moving flags between `--help` sections (or groups in
src/cli/) shows no difference and anything else does.

    scripts/help_flags.py /work/base/nbdgw > before
    scripts/help_flags.py target/debug/nbdgw > after
    diff before after     # empty: names, variables, defaults, help kept
"""
import re
import subprocess
import sys

COMMANDS = [[], ["client"], ["certs"], ["policy"], ["policy", "check"], ["policy", "explain"]]
FLAG = re.compile(r"^\s{2,6}(?:-(\w), )?--([\w-]+)(?: <([^>]+)>)?(?:\.\.\.)?(?:\s{2,}(.*))?$")


def parse(text):
    """{flag: record} from one command's long help."""
    flags, cur = {}, None
    for line in text.splitlines():
        m = FLAG.match(line)
        if m:
            cur = {"short": m.group(1) or "", "value": m.group(3) or "", "env": "",
                   "default": "", "possible": [], "help": [m.group(4)] if m.group(4) else []}
            flags[m.group(2)] = cur
        elif cur is not None and re.match(r"^\S", line):
            cur = None  # a section heading, or the text after the flags
        elif cur is not None and line.strip():
            s = line.strip()
            if s.startswith("[env: "):
                cur["env"] = s[len("[env: "):-1]
            elif s.startswith("[default: "):
                cur["default"] = s[len("[default: "):-1]
            elif s.startswith("[possible values: "):
                cur["possible"].append(s[len("[possible values: "):-1])
            elif s.startswith("- "):
                cur["possible"].append(s)
            elif s != "Possible values:":
                cur["help"].append(s)
    return flags


def main():
    binary = sys.argv[1]
    for command in COMMANDS:
        text = subprocess.run([binary, *command, "--help"], capture_output=True,
                              text=True, check=True, env={}).stdout
        flags = parse(text)
        for name in sorted(flags):
            f = flags[name]
            print(f"nbdgw {' '.join(command)}".strip(),
                  f"--{name} -{f['short']} <{f['value']}> env={f['env']} default={f['default']}"
                  f" possible={f['possible']} help={' '.join(f['help'])!r}")


if __name__ == "__main__":
    main()
