"""The --config TOML file: precedence flag > env > file > default, refusals that name the key
and the file, and --print-config's output reading back as the same configuration."""

import json
import subprocess
import sys

import pytest

from lmcache_mp.server.cache.quotas import Quota
from lmcache_mp.server.config import Config


def write(tmp_path, text: str) -> str:
    path = tmp_path / "server.toml"
    path.write_text(text)
    return str(path)


def test_file_env_and_flag_precedence(tmp_path):
    path = write(tmp_path, 'cpu_size = "2GiB"\nchunk_size = 512\nlease_timeout = 7\n'
                           'copy_threads = 3\nquota = ["team-a=1GiB:64MiB"]\n')
    config = Config.from_args(["--config", path, "--copy-threads", "5"],
                              env={"LMCACHE_MP_CHUNK_SIZE": "128", "LMCACHE_MP_COPY_THREADS": "4"})
    assert config.cpu_size == 2 * 1024**3  # the file over the default
    assert config.lease_timeout == 7.0
    assert config.chunk_size == 128  # the environment over the file
    assert config.copy_threads == 5  # the flag over the environment and the file
    assert config.quota == [("team-a", Quota(1024**3, 64 * 1024**2))]
    assert config.log_level == "info"  # in none of them: the default
    # The file may come from the environment too.
    assert Config.from_args([], env={"LMCACHE_MP_CONFIG": path}).chunk_size == 512


@pytest.mark.parametrize("text,message", [
    ("cpu_sise = 5\n", "unknown key 'cpu_sise'"),
    ('cpu_size = "lots"\n', "key 'cpu_size': invalid size 'lots'"),
    ("chunk_size = 0\n", "key 'chunk_size': must be positive"),
    ('quota = "a=1GiB"\n', "key 'quota': expected a list of strings"),
    ("copy_threads = [2]\n", "key 'copy_threads': expected a string or a number"),
    ("[metrics]\nport = 9\n", "unknown key 'metrics'"),
    ('log_format = "xml"\n', "key 'log_format': must be one of text, json"),
    ("chunk_size = \n", "not TOML"),
])
def test_bad_file_names_the_key_and_the_file(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args(["--config", path], env={})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"config file {path}" in err and message in err, err


def test_missing_file_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        Config.from_args(["--config", str(tmp_path / "absent.toml")], env={})
    assert "absent.toml" in capsys.readouterr().err


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmcache_mp.server", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_print_config_round_trips(tmp_path):
    first = run_cli("--print-config", "--cpu-size", "3GiB", "--quota", "a=b=1GiB:1MiB",
                    "--quota", "=unlimited", "--tenant-label", "team-a=alpha",
                    "--metrics-port", "9400", "--log-format", "json", "--lease-timeout", "2.5",
                    "--runtime-dir", str(tmp_path / "run"))
    assert first.returncode == 0, first.stderr
    path = write(tmp_path, first.stdout)
    second = run_cli("--print-config", "--config", path)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    config = Config.from_args(["--config", path], env={})
    assert config.cpu_size == 3 * 1024**3 and config.metrics_port == 9400
    assert config.quota == [("a=b", Quota(1024**3, 1024**2)), ("", Quota(None))]
    assert config.tenant_label == [("team-a", "alpha")]
    assert config.lease_timeout == 2.5 and config.log_format == "json"


def test_every_option_is_a_flag_an_env_var_and_a_config_key():
    help_text = run_cli("--help").stdout
    printed = run_cli("--print-config").stdout
    for name, _ in Config.from_args([], env={}).items():
        assert "--" + name.replace("_", "-") in help_text, name
        assert "LMCACHE_MP_" + name.upper() in " ".join(help_text.split()), name
        assert f"{name} = " in printed or f"# {name} is unset" in printed, name


def test_print_config_writes_every_size_one_way_and_help_says_none_the_same_way():
    printed = run_cli("--print-config", "--l2-budget", "1GiB", "--disk-dir", "/tmp/x",
                      "--disk-size", "1048577", "--default-quota", "3MiB")
    assert printed.returncode == 0, printed.stderr
    written = dict(line.split(" = ", 1) for line in printed.stdout.splitlines() if " = " in line)
    assert {name: written[name] for name in ("cpu_size", "gpu_size", "l2_queue_size",
                                             "disk_queue_size", "max_message_bytes",
                                             "l2_budget", "disk_size", "default_quota")} == {
        "cpu_size": f'"{Config.from_args([], env={}).cpu_size // 1024**2}MiB"',
        "gpu_size": '"0B"', "l2_queue_size": '"256MiB"', "disk_queue_size": '"256MiB"',
        "max_message_bytes": '"64MiB"', "l2_budget": '"1GiB"', "disk_size": '"1048577B"',
        "default_quota": '"3MiB"'}
    help_text = " ".join(run_cli("--help").stdout.split())
    assert "None" not in help_text and "(default: none;" in help_text
    assert ("--host ADDR TCP address to serve on instead of the ipc:// socket; an address "
            "beyond loopback needs --token-file (default: none: the ipc:// socket; 127.0.0.1 "
            "when only --port is given;") in help_text
    assert ("--port PORT TCP port to serve on instead of the ipc:// socket (default: none: "
            "the ipc:// socket; 5555 when only --host is given;") in help_text


def test_log_line_leaves_salts_out():
    config = Config.from_args(["--quota", "secret-salt=1GiB", "--tenant-label",
                               "other-secret=beta"], env={})
    line = config.log_line()
    assert "secret-salt" not in line and "other-secret" not in line
    assert 'quota=["<salt>=1GiB"]' in line and "<salt>=beta" in line
    assert json.loads(line.split("metrics_port=")[1].split()[0]) == 0
