"""Configuration precedence and validation (gateway.config): the runner's settings and the hub's."""

import os
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import msgspec
import pytest

import gateway.hub.cli as hub_cli
from gateway.cli import build_parser
from gateway.config import (
    HUB_SETTINGS,
    SETTINGS,
    BackendTable,
    Config,
    ConfigError,
    HubSettings,
    Setting,
    default_hub_data,
    load_config,
    load_hub_settings,
    normalize_server,
    parse_duration,
    parse_listen,
    setting_flags,
    split_project,
)
from gateway.ops import settings_doc


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
    assert config.backend == ("http://file:1/v1",)
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
        assert f"\n{settings_doc.shown_line(s)}\n" in example


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


# -- repeated --backend: a pool of backends ------------------------------------------------------


def test_backend_given_again_is_one_more_backend_of_the_pool(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "run",
            "--backend",
            "http://a:1/v1",
            "--backend",
            "http://b:2/v1/",
            "--backend",
            "http://a:1/v1",
        ]
    )
    config = load_config(setting_flags(args), {})
    assert config.backend == ("http://a:1/v1", "http://b:2/v1")  # the same URL twice: once
    assert [(b.name, b.url) for b in config.backends] == [
        ("default", "http://a:1/v1"),
        ("default-2", "http://b:2/v1"),
    ]
    # the environment and the TOML file take a list too; a flag still wins over both
    env = load_config({}, {"CHAT_LLM_BACKEND_URL": "http://e:1/v1,http://f:2/v1"})
    assert [b.name for b in env.backends] == ["default", "default-2"]
    toml = tmp_path / "c.toml"
    toml.write_text('backend = ["http://t:1/v1", "http://u:2/v1"]\n')
    assert load_config({}, {}, toml).backend == ("http://t:1/v1", "http://u:2/v1")
    assert load_config({"backend": ["http://g:1/v1"]}, {}, toml).backend == ("http://g:1/v1",)
    # one key for several backends is refused, never sent to all of them
    with pytest.raises(ConfigError, match="--backend-key with 2 --backend URLs") as info:
        load_config(setting_flags(args), {"CHAT_LLM_BACKEND_KEY": "sk-one-for-which-77"})
    assert "sk-one-for-which-77" not in str(info.value) and "\n" not in str(info.value)
    # a [[backend]] named like the second one clashes by name
    toml.write_text('[[backend]]\nname = "default-2"\nurl = "http://x:1/v1"\n')
    with pytest.raises(ConfigError, match="used twice"):
        load_config(setting_flags(args), {}, toml)


# -- the hub's settings: the same declarations, readers and docs ---------------------------------


def _hub(key: str) -> Setting:
    return next(s for s in HUB_SETTINGS if s.key == key)


# For each hub setting, a value other than its default: (as a flag, an env var or TOML text
# gives it, as a TOML value, what HubSettings then holds).
HUB_VALUES: dict[str, tuple[str, Any, Any]] = {
    "listen": ("127.0.0.1:9911", "127.0.0.1:9911", ("127.0.0.1", 9911)),
    "data": ("/tmp/hub-data-x", "/tmp/hub-data-x", Path("/tmp/hub-data-x")),
    "store": ("postgresql://a:pw@db:5/hub",) * 3,
    "store_pool": ("9", 9, 9),
    "tls_cert": ("/tmp/c.pem", "/tmp/c.pem", Path("/tmp/c.pem")),
    "tls_key": ("/tmp/k.pem", "/tmp/k.pem", Path("/tmp/k.pem")),
    "log_format": ("json", "json", "json"),
    "log_level": ("debug", "debug", "DEBUG"),
    "advertise": ("http://10.0.0.5:8787",) * 3,
    "team_secret": ("s" * 32 + ",o" + "o" * 31, "s" * 32 + ",o" + "o" * 31, ("s" * 32, "o" * 32)),
    "team_secret_file": ("/tmp/team-secret", "/tmp/team-secret", Path("/tmp/team-secret")),
    "replica_id": ("hub-1",) * 3,
    "offline_after": ("7.5", 7.5, 7.5),
    "reoffer_after": ("3", 3, 3.0),
    "ping_interval": ("0", 0, 0.0),
    "ping_timeout": ("4", 4, 4.0),
    "first_frame_timeout": ("9", 9, 9.0),
    "reconnect_timeout": ("2", 2, 2.0),
    "resume_within": ("0", 0, 0.0),
    "keepalive_interval": ("1.5", 1.5, 1.5),
    "runner_wait_timeout": ("12", 12, 12.0),
    "session_idle_timeout": ("0", 0, 0.0),
    "max_sessions_per_key": ("3", 3, 3),
    "queue_length": ("0", 0, 0),
    "queue_wait": ("2.5", 2.5, 2.5),
    "models_wait": ("6", 6, 6.0),
    "models_timeout": ("1", 1, 1.0),
    "default_model": ("qwen2.5:7b", "qwen2.5:7b", "qwen2.5:7b"),
    "count_usage": ("off", False, False),
    "key_check_interval": ("30", 30, 30.0),
    "usage_retention": ("36h", "36h", 36 * 3600.0),
    "token_reservation": ("512", 512, 512),
    "currency": ("EUR", "EUR", "EUR"),
    "priority_promote_after": ("12", 12, 12.0),
    "channel_backlog": ("65536", 65536, 65536),
    "client_backlog": ("4096", 4096, 4096),
    "head_timeout": ("4", 4, 4.0),
    "keepalive_timeout": ("45", 45, 45.0),
    "body_timeout": ("8", 8, 8.0),
    "max_body": ("2048", 2048, 2048),
    "max_connections": ("5", 5, 5),
    "max_runner_connections": ("7", 7, 7),
    "max_client_connections": ("6", 6, 6),
    "oidc_issuer": ("https://id.example/team",) * 3,
    "oidc_client_id": ("alp-hub",) * 3,
    "oidc_client_secret_file": ("/run/s/oidc", "/run/s/oidc", Path("/run/s/oidc")),
    "oidc_client_secret": ("s3cret",) * 3,
    "oidc_admin_group": ("hub-admins",) * 3,
    "oidc_groups_claim": ("roles",) * 3,
    "oidc_member_projects": (
        "acme/chat,acme/eval",
        ["acme/chat", "acme/eval"],
        ("acme/chat", "acme/eval"),
    ),
    "oidc_redirect_url": ("https://hub.example",) * 3,
    "oidc_session_lifetime": ("8h", "8h", 8 * 3600.0),
}


def test_every_hub_setting_is_a_hubsettings_field_with_a_valid_default() -> None:
    assert [s.key for s in HUB_SETTINGS] == list(HUB_VALUES)  # a new setting: add it above
    by_name = {f.name: f for f in fields(HubSettings)}
    defaults = HubSettings()
    for s in HUB_SETTINGS:
        assert s.key in by_name, s.key
        assert s.env and all(e.startswith("ALP_GATEWAY_") for e in s.env), s.key
        shown = s.sample if s.sample is not None else s.default
        if s.default is not None:  # the docs' value is the default, and passes its own check
            assert s.parse(shown) == s.default == getattr(defaults, s.key), s.key
    assert defaults.data == default_hub_data(os.environ)
    assert load_hub_settings({}, {"ALP_GATEWAY_STATE_DIR": "/s"}).data == Path("/s/hub")


@pytest.mark.parametrize("key", list(HUB_VALUES))
def test_each_hub_setting_by_flag_env_and_toml(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every hub setting reaches ``HubSettings`` from its flag (parsed by the hub command's own
    parser), its environment variable and its TOML key; precedence flag > env > file."""
    text, toml_value, wanted = HUB_VALUES[key]
    s = _hub(key)
    pair = {
        "tls_cert": ("tls_key", "/tmp/k.pem"),
        "tls_key": ("tls_cert", "/tmp/c.pem"),
        "oidc_issuer": ("oidc_client_id", "alp-hub"),
        "oidc_client_id": ("oidc_issuer", "https://id.example/team"),
    }
    other = pair.get(key)
    base_flags = [f"--{other[0].replace('_', '-')}", other[1]] if other else []
    base_env = {_hub(other[0]).env[0]: other[1]} if other else {}
    assert getattr(HubSettings(), key) != wanted, "pick a value other than the default"

    def via_flag(*flags: str, env: dict[str, str] | None = None, file: Path | None = None) -> Any:
        args = hub_cli._build_parser().parse_args([*flags, *base_flags])
        found = load_hub_settings(setting_flags(args, HUB_SETTINGS), env or {}, file)
        return getattr(found, key)

    assert via_flag(s.flag, text) == wanted
    assert getattr(load_hub_settings({}, {s.env[0]: text, **base_env}), key) == wanted
    toml = tmp_path / "hub.toml"
    toml.write_text(
        f"{key} = {settings_doc.toml_value(toml_value)}\n"
        + (f"{other[0]} = {settings_doc.toml_value(other[1])}\n" if other else "")
    )
    assert getattr(load_hub_settings({}, {}, toml), key) == wanted
    # precedence: the flag over the environment over the file (the default's text as the
    # other value, where the setting has a default)
    if s.default is not None:
        other_text = str(s.sample if s.sample is not None else s.default)
        other_text = {"True": "on"}.get(other_text, other_text)
        assert via_flag(s.flag, text, env={s.env[0]: other_text}, file=toml) == wanted
        env_wins = load_hub_settings({}, {s.env[0]: other_text, **base_env}, toml)
        assert getattr(env_wins, key) == s.default != wanted


def test_hub_settings_refused_in_one_line_naming_their_source(tmp_path: Path) -> None:
    cases: list[tuple[dict[str, Any], dict[str, str], str]] = [
        ({"ping_interval": "-1"}, {}, "--ping-interval: invalid value '-1'"),
        ({}, {"ALP_GATEWAY_HUB_QUEUE_LENGTH": "-2"}, "ALP_GATEWAY_HUB_QUEUE_LENGTH: invalid"),
        ({"max_connections": "0"}, {}, "--max-connections"),
        ({"usage_retention": "0d"}, {}, "not a duration"),
        ({"listen": "nonsense"}, {}, "--listen: invalid value 'nonsense'"),
        ({"log_level": "LOUD"}, {}, "not a log level"),
        ({"tls_cert": "/c.pem"}, {}, "--tls-cert and --tls-key go together"),
        ({"store": "mysql://a:s3cret@db/hub"}, {}, "--store: invalid value (hidden): not a Post"),
        ({}, {"ALP_GATEWAY_HUB_STORE_POOL": "0"}, "ALP_GATEWAY_HUB_STORE_POOL: invalid"),
    ]
    for flags, env, message in cases:
        with pytest.raises(ConfigError) as info:
            load_hub_settings(flags, env)
        assert message in str(info.value) and "\n" not in str(info.value), message
        assert "s3cret" not in str(info.value)  # a store URL's password is never repeated
    toml = tmp_path / "hub.toml"
    for text, message in [
        ("pign_interval = 3\n", "unknown setting 'pign_interval'"),
        ("[hub]\nlisten = 1\n", "unknown table [hub]"),
        ("backend = 'http://x/v1'\n", "unknown setting 'backend'"),  # a runner's key
        ("queue_wait = -1\n", f"queue_wait in {toml}: invalid value -1"),
    ]:
        toml.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_hub_settings({}, {}, toml)
        assert message in str(info.value) and str(toml) in str(info.value), message


def test_hub_flags_come_from_the_declarations_with_their_defaults_in_the_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert hub_cli.main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for s in HUB_SETTINGS:
        assert s.flag in text, s.flag
    assert "(env ALP_GATEWAY_HUB_QUEUE_LENGTH; default 64)" in text
    assert "emulator" not in text and "your own ALP Server" in text
    assert "state directory" not in text and "data directory" in text
    # the old name of --queue-wait still sets it
    args = hub_cli._build_parser().parse_args(["--capacity-wait", "2.5"])
    assert load_hub_settings(setting_flags(args, HUB_SETTINGS), {}).queue_wait == 2.5


def test_hub_table_and_example_file_are_generated_from_the_declarations(tmp_path: Path) -> None:
    assert settings_doc.main(["--check"]) == 0, "run: python -m gateway.ops.settings_doc"
    readme = settings_doc.README.read_text()
    table = settings_doc.HUB_TABLE
    part = readme[readme.index(table.begin) : readme.index(table.end)]
    rows = re.findall(r"^\| `--[^`]*` \(`(\w+)`\) \| [^|]* \| ([^|]*) \|", part, re.M)
    assert [key for key, _ in rows] == [s.key for s in HUB_SETTINGS]
    assert [default.strip() for _, default in rows] == [s.default_text for s in HUB_SETTINGS]
    example = settings_doc.HUB_EXAMPLE.read_text()
    assert re.findall(r"^(?:# )?(\w+) = ", example, re.M) == [s.key for s in HUB_SETTINGS]
    for s in HUB_SETTINGS:
        assert f"\n{settings_doc.shown_line(s)}\n" in example
    # the example, uncommented, is a valid file that sets every value to its default
    plain = tmp_path / "hub.toml"
    plain.write_text(re.sub(r"^# (\w+ = )", r"\1", example, flags=re.M))
    loaded = load_hub_settings({}, {}, plain)
    samples = ("data", "store", "advertise", "replica_id", "tls_cert", "tls_key")
    samples += ("ping_timeout", "default_model", "team_secret", "team_secret_file")
    samples += ("oidc_issuer", "oidc_client_id", "oidc_client_secret_file", "oidc_admin_group")
    samples += ("oidc_redirect_url", "oidc_client_secret")
    for s in HUB_SETTINGS:
        if s.key not in samples:  # no default: the example shows a sample
            assert getattr(loaded, s.key) == getattr(HubSettings(), s.key), s.key


def test_one_duration_parser() -> None:
    assert parse_duration("30m") == 1800.0 and parse_duration(" 7d ") == 7 * 86400.0
    assert parse_duration(90) == 90.0 and parse_duration("90") == 90.0
    for bad in ("soon", "0d", "-3d", 0, True):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)
