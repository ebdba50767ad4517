"""Configuration precedence and validation (gateway.config)."""

import re
from dataclasses import fields
from pathlib import Path

import msgspec
import pytest

from gateway import settings_doc
from gateway.cli import build_parser
from gateway.config import (
    SETTINGS,
    BackendTable,
    Config,
    ConfigError,
    Setting,
    load_config,
    normalize_server,
    parse_listen,
    split_project,
)


def test_one_project_parser() -> None:
    assert split_project(" /acme/chat/ ") == ("acme", "chat")
    for bad in ("noslash", "/p", "o/", "a/b/c", ""):
        with pytest.raises(ValueError, match="OWNER/PROJECT"):
            split_project(bad)


def test_server_normalisation() -> None:
    assert normalize_server("localhost:8787") == "http://localhost:8787"
    assert normalize_server("127.0.0.1") == "http://127.0.0.1"
    assert normalize_server("agentics.dk") == "https://agentics.dk"
    assert normalize_server("http://example.org/") == "http://example.org"


def test_defaults() -> None:
    config = load_config({}, {"HOME": "/home/x"})
    assert config.server == "https://agentics.dk" and not config.server_explicit
    assert config.poll_interval == 10.0 and config.max_sessions == 64
    assert config.state_dir == Path.home() / ".local/state/alp-gateway"
    assert load_config({}, {"XDG_STATE_HOME": "/xdg"}).state_dir == Path("/xdg/alp-gateway")


def test_precedence_flags_env_file(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(
        'model = "file"\nbackend = "http://file:1/v1"\npoll_interval = 3\nproject = "o/p"\n'
    )
    env = {"CHAT_LLM_MODEL": "env", "AGENTICS_SERVER": "localhost:9"}
    config = load_config({"model": None, "poll_interval": 2.5}, env, toml)
    assert config.model == "env"
    assert config.backend == "http://file:1/v1"
    assert config.poll_interval == 2.5
    assert config.server == "http://localhost:9" and config.server_explicit
    assert config.project == "o/p" and split_project(config.project) == ("o", "p")
    assert load_config({"model": "flag"}, env, toml).model == "flag"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"project": "noslash"}, "OWNER/PROJECT"),
        ({"poll_interval": -1}, "poll-interval"),
        ({"max_sessions": 0}, "max-sessions"),
        ({"backend": "ftp://x"}, "http(s) URL"),
        ({"log_format": "xml"}, "text or json"),
    ],
)
def test_invalid_values_are_one_line(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(flags, {})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_secret_not_echoed(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("backend_key = 12\nbogus = 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'bogus'"):
        load_config({}, {}, toml)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config({}, {}, tmp_path / "missing.toml")


def test_parse_listen_is_the_one_listen_parser() -> None:
    assert parse_listen("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen(":9") == ("127.0.0.1", 9)
    assert parse_listen("9464") == ("127.0.0.1", 9464)
    for bad in ("nope", "host:http", "1:65536"):
        with pytest.raises(ValueError):
            parse_listen(bad)


# -- one table: the Config, the flags, the readers and the docs come from SETTINGS --------------


def test_every_setting_is_a_config_field_with_a_valid_default() -> None:
    by_name = {f.name: f for f in fields(Config)}
    for s in SETTINGS:
        assert s.key in by_name, s.key
        if s.default is not None:
            assert s.parse(s.default) == s.default, f"{s.key}: its default fails its own check"
    defaults = Config()
    assert defaults.poll_interval == _by_key("poll_interval").default == 10.0


def _by_key(key: str) -> Setting:
    return next(s for s in SETTINGS if s.key == key)


def test_flags_come_from_the_table_with_their_defaults_in_the_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for s in SETTINGS:
        assert s.flag in text, s.flag
    assert "(env ALP_GATEWAY_POLL_INTERVAL; default 10)" in text
    # a flag is parsed once, by the setting: argparse hands over the text as given
    args = build_parser().parse_args(["run", "--poll-interval", "2.5", "--verbose-frames"])
    assert args.poll_interval == "2.5" and args.verbose_frames is True
    with pytest.raises(ConfigError, match="--poll-interval: invalid value 'x'"):
        load_config({"poll_interval": "x"}, {})


def test_readme_table_and_example_file_are_generated_from_the_table() -> None:
    assert settings_doc.main(["--check"]) == 0, "run: python -m gateway.settings_doc"
    readme = settings_doc.README.read_text()
    table = readme[readme.index(settings_doc.BEGIN) : readme.index(settings_doc.END)]
    rows = re.findall(r"^\| `--[^`]*` \(`(\w+)`\) \| [^|]* \| ([^|]*) \|", table, re.M)
    assert [key for key, _ in rows] == [s.key for s in SETTINGS]
    assert [default.strip() for _, default in rows] == [s.default_text for s in SETTINGS]
    example = settings_doc.EXAMPLE.read_text()
    keys = re.findall(r"^(?:# )?(\w+) = ", example.split("\n[[backend]]\n")[0], re.M)
    assert keys == [s.key for s in SETTINGS]
    for s in SETTINGS:
        if s.default is not None and s.example is None:
            assert f"\n# {s.key} = {settings_doc.toml_value(s.default)}\n" in example


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[alias]\n"a" = "b"\n', "unknown table [alias]"),
        ("pol_interval = 3\n", "unknown setting 'pol_interval'"),
        ('[[backend]]\nurl = "http://x:1/v1"\nkye = "k"\n', "unknown setting(s) kye"),
    ],
)
def test_unknown_tables_and_keys_are_refused_naming_file_and_key(
    tmp_path: Path, toml: str, message: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config({}, {}, path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_backend_tables_are_typed() -> None:
    table = msgspec.convert({"url": "http://x:1/v1", "models": ["m"]}, BackendTable)
    assert table.queue == 16 and table.max_concurrency is None and table.models == ["m"]
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"url": "http://x:1/v1", "queue": True}, BackendTable)
