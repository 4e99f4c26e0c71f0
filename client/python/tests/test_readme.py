"""The README's Python example runs as written (issue 13, acceptance 4):
the code block of "Using kvstash from Python", extracted from README.md,
run by Debian's python3 against a real kvstashd named by KVSTASH_SOCKET."""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "..", "..", "..", "README.md")


def readme_example() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Using kvstash from Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, f"expected one python block in the section, found {len(blocks)}"
    return blocks[0]


def test_readme_example_runs_as_written(fresh_daemon, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    env = dict(os.environ, KVSTASH_SOCKET=fresh_daemon.sock)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    m = re.fullmatch(r"seq (\d+) epoch (\d+): block (\d+) K \((\d+), (\d+), (\d+)\), "
                     r"(\d+) blocks used\n", out.stdout)
    assert m, out.stdout
    seq, _epoch, _block, *shape, used = map(int, m.groups())
    assert seq > 0 and shape == [2, 16, 8] and used == 2  # one block per layer
    # The example released its sequence and detached.
    st = subprocess.run([sys.executable, "-c", "import kvstash, json; "
                         "print(json.dumps(kvstash.stats()))"], env=env, capture_output=True,
                        text=True, timeout=60)
    assert '"sessions": []' in st.stdout and '"sequences": []' in st.stdout, st.stdout
