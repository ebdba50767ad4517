"""The persisted registrations (gateway.runner.state): one per Server and project, the first file
form migrated; owner-only, refused when readable by others; the state-directory rule
(``gateway.runner.state.private_dir``) for a directory of another user."""

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.runner.state import SavedRegistration, StateError, StateStore, WhichServer, same_server


def reg(
    project: str = "p", server: str = "http://h", token: str = "alpr_secret"
) -> SavedRegistration:
    return SavedRegistration("id1", "box", token, server, "o", project)


def test_save_is_owner_only_and_round_trips(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    store.save(reg())
    store.save(reg("q"))
    assert stat.S_IMODE(os.stat(tmp_path / "state").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    assert store.load("http://h", "o/p") == reg()
    assert store.load("http://h", "o/q") == reg("q")
    assert store.load("http://h", "o/none") is None
    assert "alpr_secret" not in repr(store.load("http://h", "o/p"))


def test_one_registration_per_server_and_project(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    first, second = reg(token="alpr_first"), reg(server="https://other:8443", token="alpr_second")
    store.save(first)
    store.save(second)
    assert store.load("http://h", "o/p") == first  # the second Server's left the first's as it was
    assert store.load("https://other:8443", "o/p") == second
    assert store.load("https://elsewhere", "o/p") is None
    assert store.registrations("o/p") == [first, second]
    again = reg(token="alpr_again")
    store.save(again)  # registering again on a Server replaces only that Server's
    assert store.load("http://h", "o/p") == again
    assert store.load("https://other:8443", "o/p") == second
    assert len(json.loads(store.path.read_text())["registrations"]) == 2
    missing = store.missing("https://elsewhere", "o/p")
    assert missing.startswith("no registration for o/p on https://elsewhere (registered on ")
    assert "alpr_" not in missing


def test_a_server_is_found_however_its_url_is_written(tmp_path: Path) -> None:
    assert same_server("http://H:80/", "http://h")
    assert same_server("https://agentics.dk", "HTTPS://agentics.dk:443")
    assert not same_server("http://h", "https://h")
    assert not same_server("http://h:8787", "http://h:8788")
    assert not same_server("http://h/a", "http://h/b")
    store = StateStore(tmp_path)
    store.save(reg(server="http://127.0.0.1:8787/"))
    assert store.load("http://127.0.0.1:8787", "o/p") is not None


def test_without_a_server_given_the_projects_only_registration_is_used(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save(reg(server="http://hub:8787"))
    default = "https://agentics.dk"
    assert store.find(default, "o/p", server_given=False) == reg(server="http://hub:8787")
    assert store.find(default, "o/p", server_given=True) is None
    store.save(reg(server="http://other:8787"))
    with pytest.raises(WhichServer, match="registrations for o/p on http://hub:8787, http://other"):
        store.find(default, "o/p", server_given=False)
    store.save(reg(server=default))  # one at the default Server: that one, without asking
    assert store.find(default, "o/p", server_given=False) == reg(server=default)


def test_the_first_file_form_is_read_and_migrated_at_the_next_save(tmp_path: Path) -> None:
    """``{"registrations": {"OWNER/PROJECT": {...}}}``: one registration per project."""
    store = StateStore(tmp_path)
    old = reg(token="alpr_old")
    body = {"registrations": {"o/p": {**old.__dict__}}}
    store.path.write_text(json.dumps(body))
    os.chmod(store.path, 0o600)
    assert store.load("http://h", "o/p") == old
    assert store.load("http://other", "o/p") is None
    store.save(reg(server="http://other", token="alpr_new"))
    data = json.loads(store.path.read_text())
    assert data["version"] == 2 and isinstance(data["registrations"], list)
    assert store.load("http://h", "o/p") == old  # kept, with its token
    assert store.load("http://other", "o/p") == reg(server="http://other", token="alpr_new")


def test_readable_by_others_is_refused(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save(reg())
    os.chmod(store.path, 0o644)
    with pytest.raises(StateError, match="readable by others"):
        store.load("http://h", "o/p")


def test_garbage_file_is_a_clear_error(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.path.write_text("{")
    os.chmod(store.path, 0o600)
    with pytest.raises(StateError, match="not a registration file"):
        store.load("http://h", "o/p")


NOBODY = 65532  # the image's and the Kubernetes manifest's uid


def as_user(uid: int, action: Callable[[], str]) -> str:
    """Run ``action`` in a forked child with ``uid`` as its user and group (no other groups):
    what ``setpriv --reuid=UID --regid=UID --clear-groups`` does. Its result or its error."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = action()
        except BaseException as exc:  # noqa: B036 - everything goes back to the parent
            out, code = f"{type(exc).__name__}: {exc}", 1
        os.write(write, out.encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    return out if os.waitstatus_to_exitcode(status) == 0 else f"failed: {out}"


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="changes user (as setpriv does): needs to run as root"
)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A root-owned 0777 directory reachable by any user: a Kubernetes emptyDir."""
    where = Path(tempfile.mkdtemp(prefix="emptydir-", dir="/tmp"))
    os.chmod(where, 0o777)
    yield where
    shutil.rmtree(where)


@needs_root
def test_an_emptydir_owned_by_root_gets_a_private_subdirectory(shared_dir: Path) -> None:
    def save_and_load() -> str:
        store = StateStore(shared_dir)
        store.save(reg())
        assert store.load("http://h", "o/p") == reg()
        return str(store.path)

    assert as_user(NOBODY, save_and_load) == f"{shared_dir}/uid-{NOBODY}/registration.json"
    private = shared_dir / f"uid-{NOBODY}"
    st = os.stat(private)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o700)
    st = os.stat(private / "registration.json")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o600)
    # the shared directory itself is left as it was
    st = os.stat(shared_dir)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o777)
    # a restarted runner (a new container in the same pod) finds its registration again
    assert as_user(NOBODY, lambda: repr(StateStore(shared_dir).load("http://h", "o/p"))) == repr(
        reg()
    )


@needs_root
def test_a_subdirectory_someone_else_made_is_refused(shared_dir: Path) -> None:
    os.mkdir(shared_dir / f"uid-{NOBODY}", 0o777)  # made by root, before the runner
    out = as_user(NOBODY, lambda: str(StateStore(shared_dir).save(reg())))
    assert out.startswith("failed: StateError: ")
    assert "is not a directory of this runner's user" in out


@needs_root
def test_a_directory_the_runner_may_not_write_is_one_clear_line(shared_dir: Path) -> None:
    os.chmod(shared_dir, 0o755)  # a root-owned bind mount
    out = as_user(NOBODY, lambda: str(StateStore(shared_dir).save(reg())))
    assert f"it belongs to uid 0 (mode 755) and uid {NOBODY} may not write in it" in out
    assert f"`chown {NOBODY} {shared_dir}`" in out


def test_an_own_0777_directory_is_made_0700_when_loaded(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    store.save(reg())
    os.chmod(store.dir, 0o777)
    assert store.load("http://h", "o/p") == reg()
    assert stat.S_IMODE(os.stat(store.dir).st_mode) == 0o700
    assert store.path == tmp_path / "state" / "registration.json"


@needs_root
def test_a_token_file_of_another_user_is_refused(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save(reg())
    os.chown(store.path, NOBODY, NOBODY)
    with pytest.raises(StateError, match=f"belongs to uid {NOBODY}, not to this runner"):
        store.load("http://h", "o/p")
