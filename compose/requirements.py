"""Print pyproject.toml's runtime dependencies, one a line, less the names given as arguments.

The image build installs these first, from the project metadata alone, so that a code change
rebuilds only the last layers; the CPU image leaves out Triton, which CPU processes never import.
"""

import re
import sys

import tomllib


def main() -> None:
    skip = {name.lower() for name in sys.argv[1:]}
    with open("pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    for dep in deps:
        name = re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].strip().lower()
        if name not in skip:
            print(dep)


if __name__ == "__main__":
    main()
