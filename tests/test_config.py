"""Configuration precedence and validation (gateway.config)."""

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, normalize_server, parse_listen


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
    assert config.project == "o/p" and config.owner == "o" and config.project_name == "p"
    assert config.base_url == "http://localhost:9/api/owners/o/projects/p"
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
