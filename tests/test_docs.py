"""The docs say what the code and the scripts do: the README's hub walk-through asks for a model its
path serves, the binary's size is one figure everywhere, no script names a Debian mirror, and the
hub's ``--data`` is "the data directory" wherever the docs name it."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from gateway.sim.cli import _build_parser as sim_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DEPLOY = ROOT / "packaging" / "DEPLOY.md"
MIRROR_SCRIPT = ROOT / "packaging" / "debian-mirror.sh"


def section(text: str, heading: str) -> str:
    """The Markdown section under ``heading`` (a ``## `` line), up to the next ``## `` heading."""
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def shell_commands(markdown: str) -> list[list[str]]:
    """Each command of the ``sh`` blocks, as words: continuation lines joined, comments,
    redirections and a trailing ``&`` dropped, ``A=B`` assignments before the command kept."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", markdown, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = [
                w
                for w in shlex.split(line, comments=True)
                if w != "&" and not re.match(r"^\d?>", w)
            ]
            if words:
                commands.append(words)
    return commands


def alp_gateway(words: list[str], sub: str) -> list[str] | None:
    """The arguments after ``alp-gateway SUB`` in a command, or None when it is not one."""
    for i, word in enumerate(words[:-1]):
        if word == "alp-gateway" and words[i + 1] == sub:
            return words[i + 2 :]
    return None


def walkthrough_mistakes(readme: str) -> list[str]:
    """What is wrong with the hub walk-through's path (its steps, before Clients): it must start
    one simulator, point the runner at it, and ask only for models the simulator serves."""
    walk = section(readme, "## Self-hosting with the hub")
    walk = walk[: walk.index("\n### ")]
    commands = shell_commands(walk)
    sims = [args for c in commands if (args := alp_gateway(c, "sim")) is not None]
    if len(sims) != 1:
        return [f"{len(sims)} simulators started, not one"]
    sim = sim_parser().parse_args(sims[0])
    served = sim.models.split(",")
    mistakes = []
    runs = [args for c in commands if (args := alp_gateway(c, "run")) is not None]
    backends = [args[i + 1] for args in runs for i, w in enumerate(args) if w == "--backend"]
    if backends != [f"http://{sim.listen}/v1"]:
        mistakes.append(f"the runners' backends {backends} are not the simulator's {sim.listen}")
    asked = [
        json.loads(c[c.index("-d") + 1])["model"] for c in commands if c[0] == "curl" and "-d" in c
    ]
    if not asked:
        mistakes.append("no chat request")
    mistakes += [f"asks for {m!r}; the simulator serves {served}" for m in asked if m not in served]
    mistakes += [f"the prose never names {m!r}" for m in served if f"`{m}`" not in walk]
    return mistakes


def test_the_hub_walkthrough_asks_for_a_model_its_path_serves() -> None:
    readme = README.read_text()
    assert walkthrough_mistakes(readme) == []
    # and the check sees the mistakes it is for
    wrong_model = readme.replace('"model": "sim-model"', '"model": "qwen2.5:7b"')
    assert wrong_model != readme
    assert walkthrough_mistakes(wrong_model) == [
        "asks for 'qwen2.5:7b'; the simulator serves ['sim-model']"
    ]
    ollama = readme.replace(
        "--backend http://127.0.0.1:8789/v1", "--backend http://127.0.0.1:11434/v1"
    )
    assert ollama != readme and "not the simulator's" in walkthrough_mistakes(ollama)[0]


# "one 14 MB file", "the binary is 14 MB", the Measured table's "binary size ... | 14.05 MB"
SIZE = re.compile(
    r"one (\d+(?:\.\d+)?) MB file|binary is (\d+(?:\.\d+)?) MB"
    r"|binary size \(`dist/alp-gateway`[^|\n]*\| (\d+(?:\.\d+)?) MB"
)


def stated_binary_sizes(path: Path) -> list[float]:
    """Every size in MB that ``path`` states for the x86_64 binary."""
    return [float(next(g for g in m.groups() if g)) for m in SIZE.finditer(path.read_text())]


def test_readme_and_deploy_state_one_binary_size() -> None:
    readme, deploy = stated_binary_sizes(README), stated_binary_sizes(DEPLOY)
    assert len(readme) >= 1 and len(deploy) >= 3, (readme, deploy)
    assert {round(s) for s in readme + deploy} == {round(readme[0])}, (readme, deploy)
    assert not re.search(r"\b11 MB\b", README.read_text() + DEPLOY.read_text())


def test_packaging_scripts_name_no_debian_mirror() -> None:
    """A mirror comes from the machine's apt sources (or DEBIAN_MIRROR), never from the code."""
    scripts = sorted((ROOT / "packaging").rglob("*.sh")) + [ROOT / "packaging" / "Dockerfile"]
    assert MIRROR_SCRIPT in scripts
    mirror_url = re.compile(r"\b(?:https?|ftp)://[^\s\"')]*debian", re.I)
    for script in scripts:
        for n, line in enumerate(script.read_text().splitlines(), 1):
            assert not mirror_url.search(line), f"{script.name}:{n} names a Debian mirror: {line}"
    for user in ("build-arm64.sh", "prove-lib.sh"):  # prove-lib.sh: prove.sh's and prove-team.sh's
        assert "packaging/debian-mirror.sh" in (ROOT / "packaging" / user).read_text()


def mirror(apt: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    run = subprocess.run(
        ["bash", str(MIRROR_SCRIPT), *args],
        env={"PATH": "/usr/bin:/bin", "APT_DIR": str(apt), **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return run.returncode, run.stdout.strip(), run.stderr.strip()


DEB822 = """\
Types: deb
URIs: http://security.example.org/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src.example.org/debian
Suites: bookworm

Types: deb
URIs: http://off.example.org/debian
Suites: bookworm
Enabled: no

# a comment
types: deb deb-src
uris: http://mirror.example.org/debian/
suites: bookworm bookworm-updates
signed-by:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 mQINBF
 -----END PGP PUBLIC KEY BLOCK-----
components: main
"""


def test_the_mirror_is_the_machines_own(tmp_path: Path) -> None:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    # none: one line naming DEBIAN_MIRROR, exit 2
    code, out, err = mirror(apt, "bookworm")
    assert (code, out) == (2, "") and "DEBIAN_MIRROR" in err and len(err.splitlines()) == 1
    # deb822: the enabled `deb` stanza serving bookworm, not security, deb-src or a disabled one
    (apt / "sources.list.d" / "debian.sources").write_text(DEB822)
    assert mirror(apt, "bookworm")[:2] == (0, "http://mirror.example.org/debian")
    # DEBIAN_MIRROR wins
    env = {"DEBIAN_MIRROR": "http://override.example.org/debian"}
    assert mirror(apt, "bookworm", env=env)[1] == "http://override.example.org/debian"
    # a trixie machine's Debian mirror serves bookworm too: its /debian archive, not security
    (apt / "sources.list.d" / "debian.sources").write_text(DEB822.replace("bookworm", "trixie"))
    assert mirror(apt, "bookworm")[:2] == (0, "http://mirror.example.org/debian")
    # one-line format, options in brackets, comments, deb-src skipped
    (apt / "sources.list.d" / "debian.sources").unlink()
    (apt / "sources.list").write_text(
        "# deb http://commented.example.org/debian bookworm main\n"
        "deb-src http://src.example.org/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://line.example.org/debian bookworm main\n"
    )
    assert mirror(apt, "bookworm")[:2] == (0, "http://line.example.org/debian")
    # an Ubuntu machine: no Debian source; it says so
    (apt / "sources.list").write_text("deb http://archive.ubuntu.com/ubuntu noble main\n")
    code, out, err = mirror(apt, "bookworm")
    assert code == 2 and "DEBIAN_MIRROR" in err


def test_the_hubs_data_is_the_data_directory() -> None:
    """Wherever the docs name the hub's ``--data``, they call it the data directory."""
    docs = [README, DEPLOY, *sorted((ROOT / "docs").glob("*.md"))]
    named = 0
    for doc in docs:
        for paragraph in re.split(r"\n\s*\n", doc.read_text()):
            if re.search(r"--data\b", paragraph):
                named += 1
                assert "data directory" in paragraph, f"{doc.name}: {paragraph[:200]}"
                assert "state directory" not in paragraph, f"{doc.name}: {paragraph[:200]}"
    assert named >= 3


@pytest.mark.parametrize(
    "script",
    ["build-arm64.sh", "prove.sh", "prove-lib.sh", "prove-team.sh", "debian-mirror.sh", "build.sh"],
)
def test_packaging_scripts_parse(script: str) -> None:
    run = subprocess.run(
        ["bash", "-n", str(ROOT / "packaging" / script)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def wait_loops(readme: str) -> list[str]:
    """The walk-through's wait loops: each ``until`` line with its continuation, as written."""
    walk = section(readme, "## Self-hosting with the hub")
    loops = []
    for block in re.findall(r"```sh\n(.*?)```", walk, re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if "until " in line:
                loop = [line]
                while not loop[-1].rstrip().endswith("done") and i + len(loop) < len(lines):
                    loop.append(lines[i + len(loop)])
                loops.append("\n".join(loop))
    return loops


def test_the_readmes_wait_loops_end_and_show_the_logs_cause(tmp_path: Path) -> None:
    """Each wait loop of the walk-through, run as written by sh against a port where nothing
    answers (its sleeps cut to 0: the bound is its count, not the clock): it ends by itself and
    shows the end of the log it names (issue 37, point 5)."""
    loops = wait_loops(README.read_text())
    assert len(loops) == 2, loops
    for loop in loops:
        log = re.search(r"tail -n \d+ (\S+\.log)", loop)
        assert log, f"the loop shows no log: {loop}"
        (tmp_path / log.group(1)).write_text("… WARNING backend default: connection refused\n")
        dead = re.sub(r"127\.0\.0\.1:8787", "127.0.0.1:9", loop)  # the discard port: refused
        dead = re.sub(r"sleep [0-9.]+", "sleep 0", dead)
        done = subprocess.run(
            ["sh", "-c", dead], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert "after" in done.stdout and "connection refused" in done.stdout, done.stdout
