"""Regenerates tests/ds4/vectors/ from a ds4 checkout, with ds4's own code.

    python tests/ds4/generate.py /path/to/ds4        (needs a C compiler)

gen_vectors.c calls ds4's writers and readers (server_part.c and
agent_part.c include ds4_server.c and ds4_agent.c with their main()
renamed); the engine functions those files reference but these calls never
reach are linked to stubs that abort.  The vectors, what ds4's readers made
of them (expected.txt) and the ds4 commit (COMMIT) land in vectors/, which
tests/test_ds4.py checks kvstore against.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["gen_vectors.c", "server_part.c", "agent_part.c"]
DS4_SOURCES = ["ds4_kvstore.c", "rax.c", "linenoise.c"]


def _link(build, cc, ds4):
    cmd = [cc, "-O0", "-w", f"-I{ds4}", "-o", os.path.join(build, "gen")]
    cmd += [os.path.join(HERE, s) for s in SOURCES] + [os.path.join(ds4, s) for s in DS4_SOURCES]
    cmd += [os.path.join(build, "stubs.c"), "-lpthread", "-lm"]
    return subprocess.run(cmd, capture_output=True, text=True)


def main(argv):
    if len(argv) != 2 or not os.path.isfile(os.path.join(argv[1], "ds4_kvstore.c")):
        print("usage: python tests/ds4/generate.py DS4_CHECKOUT", file=sys.stderr)
        return 2
    ds4, cc = os.path.abspath(argv[1]), os.environ.get("CC", "cc")
    commit = subprocess.run(["git", "-C", ds4, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as build:
        stubs = os.path.join(build, "stubs.c")
        with open(stubs, "w") as f:
            f.write("")
        missing = sorted(set(re.findall(r"undefined reference to `([A-Za-z_][A-Za-z0-9_]*)'", _link(build, cc, ds4).stderr)))
        with open(stubs, "w") as f:
            f.write("#include <stdlib.h>\n" + "".join(f"void {name}(void) {{ abort(); }}\n" for name in missing))
        done = _link(build, cc, ds4)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        out = os.path.join(HERE, "vectors")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        subprocess.run([os.path.join(build, "gen"), out], check=True)
    with open(os.path.join(out, "COMMIT"), "w") as f:
        f.write((commit or "unknown") + "\n")
    print(f"wrote {out} from ds4 {commit or '(not a git checkout)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
