"""A service's settings: flag > PATCHSWARM_* > TOML file > default, and `patchswarm config check`.

Parsing goes through the real CLI (`parse`), so every flag of every service is
layered by the same code the services run; `config check` runs in-process and
as the command a person types.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patchswarm.node.cli import build_parser, main, parse
from patchswarm.node.net import config
from patchswarm.protocol.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
NODE = ["node", "--tracker", "t:1", "--creds", "c", "--data-dir", "d", "--region", "r0"]


def write(tmp_path: Path, text: str, name: str = "node.toml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).lstrip())
    return p


def test_defaults_stand_when_no_layer_gives_a_value():
    args = parse(NODE, environ={})
    assert args.upload_limit is None and args.download_limit is None  # unlimited unless set
    assert args.spool_bytes == 1 << 30 and args.listen == "127.0.0.1:0" and args.config is None
    assert args.log_format == "text" and args.no_peers is False


def test_file_gives_what_the_command_line_does_not(tmp_path):
    f = write(tmp_path, """
        service = "node"
        tracker = "tracker.example:7700"
        creds = "/etc/patchswarm/creds"
        data-dir = "/var/lib/patchswarm"
        region = "us-east"
        upload_limit = "200M"
        spool-bytes = 1048576
        no-peers = true
        log-format = "json"
    """)
    args = parse(["node", "--config", str(f)], environ={})
    assert args.tracker == "tracker.example:7700" and args.region == "us-east"
    assert args.data_dir == Path("/var/lib/patchswarm") and args.creds == Path("/etc/patchswarm/creds")
    assert args.upload_limit == 200e6 and args.spool_bytes == 1 << 20 and args.no_peers is True
    assert args.log_format == "json"


def test_env_overrides_the_file(tmp_path):
    f = write(tmp_path, """
        region = "from-file"
        upload-limit = "200M"
        no-peers = true
    """)
    env = {"PATCHSWARM_REGION": "from-env", "PATCHSWARM_UPLOAD_LIMIT": "1G", "PATCHSWARM_NO_PEERS": "0"}
    args = parse(["node", "--config", str(f), "--tracker", "t:1", "--creds", "c", "--data-dir", "d"], environ=env)
    assert args.region == "from-env" and args.upload_limit == 1e9 and args.no_peers is False


def test_flag_overrides_env_and_file(tmp_path):
    f = write(tmp_path, 'region = "from-file"\nupload-limit = "200M"\n')
    env = {"PATCHSWARM_REGION": "from-env", "PATCHSWARM_UPLOAD_LIMIT": "1G", "PATCHSWARM_CONFIG": str(f)}
    args = parse(["node", "--tracker", "t:1", "--creds", "c", "--data-dir", "d", "--region", "from-flag",
                  "--upload-limit", "5M"], environ=env)
    assert args.region == "from-flag" and args.upload_limit == 5e6
    assert args.config == f  # the file came from PATCHSWARM_CONFIG


def test_config_flag_overrides_config_env(tmp_path):
    a = write(tmp_path, 'region = "a"\n', "a.toml")
    b = write(tmp_path, 'region = "b"\n', "b.toml")
    args = parse(["node", "--config", str(b), "--tracker", "t:1", "--creds", "c", "--data-dir", "d"],
                 environ={"PATCHSWARM_CONFIG": str(a)})
    assert args.region == "b"


def test_required_flags_may_come_from_any_layer_but_must_come(tmp_path, capsys):
    env = {"PATCHSWARM_TRACKER": "t:1", "PATCHSWARM_CREDS": "c", "PATCHSWARM_DATA_DIR": "d"}
    with pytest.raises(SystemExit) as e:
        parse(["node"], environ=env)
    assert e.value.code == 2
    problems = capsys.readouterr().err.split("bad configuration:")[1]
    assert "--region: required" in problems and "PATCHSWARM_REGION" in problems and "--tracker" not in problems
    assert parse(["node"], environ={**env, "PATCHSWARM_REGION": "r"}).region == "r"


def test_bad_values_in_the_environment_are_refused_with_the_variable(capsys):
    with pytest.raises(SystemExit):
        parse(NODE, environ={"PATCHSWARM_UPLOAD_LIMIT": "fast", "PATCHSWARM_NO_PEERS": "maybe",
                             "PATCHSWARM_LOG_FORMAT": "xml", "PATCHSWARM_METRICS": "nowhere"})
    err = capsys.readouterr().err
    for name in ("PATCHSWARM_UPLOAD_LIMIT", "PATCHSWARM_NO_PEERS", "PATCHSWARM_LOG_FORMAT", "PATCHSWARM_METRICS"):
        assert name in err
    assert "'fast'" in err and "'maybe'" in err and "'xml'" in err


def test_a_file_for_another_service_is_refused(tmp_path, capsys):
    f = write(tmp_path, 'service = "tracker"\n')
    with pytest.raises(SystemExit):
        parse([*NODE, "--config", str(f)], environ={})
    assert f"{f}:1: service: this file is for 'tracker'" in capsys.readouterr().err


BAD = """
    service = "node"
    # the tracker
    tracker = "t:1"
    upload-limit = "lots"
    spool-bytes = "big"
    bogus = 3
    log-format = "xml"
    no-peers = "yes"
    watch = '''
    region = 4
    '''
    listen = [
      "a",
    ]
    [extra]
    region = "r"
"""


def test_check_reports_each_unknown_key_and_bad_value_with_its_line(tmp_path):
    f = write(tmp_path, BAD)
    got = {(p.line, p.message.split(":")[0]) for p in config.check_file(build_parser().subcommands["node"], "node", f)}
    assert got == {(4, "upload-limit"), (5, "spool-bytes"), (6, "bogus"), (7, "log-format"), (8, "no-peers"),
                   (9, "watch"), (12, "listen"), (15, "extra")}


def test_check_messages_say_what_was_expected_and_found(tmp_path):
    f = write(tmp_path, BAD)
    text = {p.line: p.message for p in config.check_file(build_parser().subcommands["node"], "node", f)}
    assert "expected bytes per second" in text[4] and "'lots'" in text[4]
    assert "invalid int value" in text[5] or "'big'" in text[5]
    assert "unknown key" in text[6] and "upload-limit" in text[6]
    assert "expected one of text, json" in text[7]
    assert "expected true or false" in text[8]
    assert "unknown key" in text[9]  # the node has no --watch: the origin does
    assert "expected a string or a number" in text[12]
    assert "unknown table" in text[15]


def test_check_reports_toml_syntax_with_its_line(tmp_path):
    f = write(tmp_path, 'service = "node"\nregion = "r"\nregion = "again"\n')
    (p,) = config.check_file(build_parser().subcommands["node"], "node", f)
    assert p.line == 3 and "not TOML" in p.message


def test_check_reports_a_file_that_is_not_utf8_with_its_line(tmp_path, capsys):
    """TOML is UTF-8: a Latin-1 file raised UnicodeDecodeError out of `config check` (and out of
    every service started with it) as a traceback. It is a problem with the line of its first bad byte."""
    f = tmp_path / "node.toml"
    f.write_bytes(b'service = "node"\nregion = "caf\xe9"\n')
    (p,) = config.check_file(build_parser().subcommands["node"], "node", f)
    assert p.line == 2 and "expected UTF-8 text, found byte 0xe9" in p.message
    assert main(["config", "check", str(f)]) == 1  # no service readable: the syntax problem alone
    assert capsys.readouterr().out.startswith(f"{f}:2: not TOML")
    with pytest.raises(SystemExit):
        parse([*NODE, "--config", str(f)])
    assert f"{f}:2: not TOML" in capsys.readouterr().err


@pytest.mark.parametrize("made_bad", [b'region = "caf\xe9"\n', b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n",
                                      b"x = " + b"9" * 5000 + b"\n"])
def test_a_file_made_bad_while_a_service_runs_is_a_usage_error_on_reread(tmp_path, made_bad):
    """SIGHUP re-reads the file (node/cli `reread`); run_service keeps the configuration in use on a
    PatchswarmError or OSError. A file saved as Latin-1 raised UnicodeDecodeError, one nested
    deeper than tomllib's recursion RecursionError, and an integer of 5,000 digits ValueError (past
    Python's int-from-text limit): each went past that handler and the running tracker exited."""
    f = write(tmp_path, 'service = "node"\nregion = "r0"\n')
    args = parse(["node", "--tracker", "t:1", "--creds", "c", "--data-dir", "d", "--config", str(f)])
    f.write_bytes(b'service = "node"\n' + made_bad)
    with pytest.raises(UsageError, match=f"{f}:2: not TOML"):
        args.reread()


def test_check_reports_nesting_past_the_parser_with_its_line(tmp_path):
    """tomllib recurses per nested array: `x = [[[...` 5,000 deep raised RecursionError out of
    `config check` as a traceback."""
    f = write(tmp_path, 'service = "node"\nregion = "r0"\nx = [\n' + "[" * 5000 + "]" * 5001 + "\n")
    (p,) = config.check_file(build_parser().subcommands["node"], "node", f)
    assert p.line == 4 and "nested at most 100 deep" in p.message


@pytest.mark.parametrize("seeds", ["0", "-1", "1.5"])
def test_check_refuses_notice_seeds_the_tracker_would_not_start_with(tmp_path, seeds):
    """`notice-seeds = 0` was ok for `config check`, and the tracker then refused to start with it."""
    f = write(tmp_path, f'service = "tracker"\nnotice-seeds = {seeds}\n', "tracker.toml")
    (p,) = config.check_file(build_parser().subcommands["tracker"], "tracker", f)
    assert p.line == 2 and f"expected a whole number >= 1, found '{seeds}'" in p.message
    good = write(tmp_path, 'service = "tracker"\nnotice-seeds = 3\n', "good.toml")
    assert config.check_file(build_parser().subcommands["tracker"], "tracker", good) == []


@pytest.mark.parametrize("service, region, fault", [
    ("node", '""', "a non-empty str"),
    ("node", '"eu\\twest"', "printable characters"),
    ("origin", '"' + "r" * 257 + '"', "at most 256 bytes of UTF-8"),
])
def test_check_refuses_a_region_no_member_may_have(tmp_path, service, region, fault):
    """`region = ""` (or one of control characters, or over 256 bytes) was ok for `config
    check`, and the service then refused to start with it."""
    f = write(tmp_path, f'service = "{service}"\nregion = {region}\n', "s.toml")
    (p,) = config.check_file(build_parser().subcommands[service], service, f)
    assert p.line == 2 and f"expected {fault}" in p.message, p.message
    good = write(tmp_path, f'service = "{service}"\nregion = "eu-west 1"\n', "good.toml")
    assert [p for p in config.check_file(build_parser().subcommands[service], service, good) if p.line == 2] == []


def test_config_check_command(tmp_path, capsys):
    good = write(tmp_path, 'service = "origin"\ntracker = "t:1"\nwatch = "/srv/ckpt"\nserved = "fp16"\n',
                 "origin.toml")
    assert main(["config", "check", str(good)]) == 0
    assert "ok for `patchswarm origin`" in capsys.readouterr().out
    bad = write(tmp_path, BAD)
    assert main(["config", "check", str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 8 and all(line.startswith(f"{bad}:") for line in out)
    unnamed = write(tmp_path, 'listen = "0.0.0.0:7700"\n', "t.toml")
    assert main(["config", "check", str(unnamed), "--service", "tracker"]) == 0
    assert main(["config", "check", str(unnamed)]) == 1
    assert "say which service" in capsys.readouterr().err


@pytest.mark.slow
def test_config_check_as_typed(tmp_path):
    bad = write(tmp_path, BAD)
    r = subprocess.run([sys.executable, "-m", "patchswarm.node.cli", "config", "check", str(bad)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"{bad}:4: upload-limit:" in r.stdout and "Traceback" not in r.stderr


def test_every_service_flag_is_configurable():
    """The keys are derived from the parser: each service flag has a file key and a variable."""
    parser = build_parser()
    for name in ("tracker", "origin", "node"):
        p = parser.subcommands[name]
        assert config.is_layered(p)
        flags = {a.dest for a in p._actions if a.option_strings} - config.NOT_CONFIGURABLE
        assert flags <= {a.dest for a in config._options(p)}
        assert {"metrics", "log_format", "listen", "creds"} <= flags


def test_each_flags_variable_and_file_key_are_its_own_name():
    """A flag whose dest differs from its name (`--no-keep-keyframe` stored as keep_keyframe)
    read PATCHSWARM_KEEP_KEYFRAME=1 as "drop it": each variable is the flag's name, and a
    switch set by any layer means what the flag means."""
    parser = build_parser()
    for name in ("tracker", "origin", "node"):
        for a in config._options(parser.subcommands[name]):
            assert config.env_name(a) == config.ENV_PREFIX + config._key(a).upper().replace("-", "_"), a.option_strings
    base = [*NODE]
    assert not parse(base, environ={}).no_keep_keyframe
    assert parse(base, environ={"PATCHSWARM_NO_KEEP_KEYFRAME": "1"}).no_keep_keyframe
    assert parse([*base, "--no-keep-keyframe"], environ={}).no_keep_keyframe


def test_env_lists_and_switches():
    p = build_parser().subcommands["node"]
    no_peers = next(a for a in p._actions if a.dest == "no_peers")
    assert [config.convert(no_peers, w, from_env=True) for w in ("1", "true", "ON", "0", "no", "")] == \
           [True, True, True, False, False, False]


def test_wan_rates_from_the_file_and_the_command_line(tmp_path, capsys):
    f = write(tmp_path, """
        service = "node"
        wan-rates = "us-east=100, eu-west=50,ap-south=20"
    """)
    args = parse([*NODE, "--config", str(f)], environ={})
    assert args.wan_rates == {"us-east": 100.0, "eu-west": 50.0, "ap-south": 20.0}
    assert parse(NODE, environ={}).wan_rates is None
    assert parse([*NODE, "--wan-rates", "r0=1e3"], environ={}).wan_rates == {"r0": 1000.0}
    for bad in ("r0", "r0=0", "r0=fast", "=5"):
        with pytest.raises(SystemExit):
            parse([*NODE, "--wan-rates", bad], environ={})
        assert "REGION=MBIT" in capsys.readouterr().err


def test_check_reports_an_integer_past_pythons_limit_with_its_line(tmp_path):
    """tomllib reads integers with int(), which refuses more than 4,300 digits with a ValueError that
    is not a TOMLDecodeError: it escaped `config check` as a traceback."""
    f = write(tmp_path, 'service = "tracker"\nlisten = "127.0.0.1:0"\nnotice-seeds = ' + "9" * 5000 + "\n", "t.toml")
    (p,) = config.check_file(build_parser().subcommands["tracker"], "tracker", f)
    assert p.line == 3 and "expected integers of at most 4300 digits" in p.message
