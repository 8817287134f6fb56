import dataclasses
import subprocess
import sys

import pytest
import torch

from lmcache_mp.protocol import MAX_CHUNKS_PER_MESSAGE
from lmcache_mp.server.config import Config
from lmcache_mp.sizes import parse_size


@pytest.mark.parametrize("text,expected", [
    ("1048576", 1048576), ("512MiB", 512 * 1024**2), ("4GiB", 4 * 1024**3), ("2gb", 2 * 10**9),
    ("1.5GiB", int(1.5 * 1024**3)), (" 64 KiB ", 64 * 1024),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1GiB", "GiB", "4 parsecs", "1e9"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_defaults_bind_the_private_ipc_socket():
    config = Config.from_args(["--runtime-dir", "/tmp/lmcache-mp-cfg"], env={})
    assert config.bind_url == "ipc:///tmp/lmcache-mp-cfg/server.sock"
    assert Config.from_args(["--port", "6001"], env={}).bind_url == "tcp://127.0.0.1:6001"
    assert Config.from_args(["--host", "127.0.0.2"], env={}).bind_url == "tcp://127.0.0.2:5555"
    assert config.chunk_size == 256
    assert 256 * 1024**2 <= config.cpu_size <= 32 * 1024**3


def test_flags_override_env_which_override_defaults():
    env = {"LMCACHE_MP_PORT": "6000", "LMCACHE_MP_CPU_SIZE": "1GiB",
           "LMCACHE_MP_LOG_LEVEL": "debug"}
    config = Config.from_args(["--port", "7000"], env=env)
    assert config.port == 7000
    assert config.cpu_size == 1024**3
    assert config.log_level == "debug"
    assert Config.from_args(["--url", "ipc:///tmp/x.sock"], env={}).bind_url == "ipc:///tmp/x.sock"


@pytest.mark.parametrize("argv", [
    ["--cpu-size", "lots"], ["--chunk-size", "0"], ["--lease-timeout", "-1"],
    ["--log-level", "loud"], ["--url", "http://x"], ["--cpu-size", "1KiB"],
])
def test_bad_flags_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args(argv, env={})
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_bad_env_value_names_the_variable(capsys):
    with pytest.raises(SystemExit):
        Config.from_args([], env={"LMCACHE_MP_COPY_THREADS": "many"})
    assert "LMCACHE_MP_COPY_THREADS" in capsys.readouterr().err


def test_help_explains_every_option():
    out = subprocess.run([sys.executable, "-m", "lmcache_mp.server", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        assert flag in out
        assert "LMCACHE_MP_" + field.name.upper() in out.replace("\n", "").replace(" ", "")


@pytest.mark.parametrize("argv", [["--help"], ["--print-config"], ["--cpu-size", "1"],
                                  ["quota", "--help"]])
def test_flags_are_answered_without_importing_torch(argv):
    """torch takes seconds to import: an operator's --help, --print-config or typo, and the
    quota command, go without it (the server imports it once it serves)."""
    probe = ("import runpy, sys\n"
             f"sys.argv = ['lmcache-mp-server', *{argv!r}]\n"
             "try:\n"
             "    runpy.run_module('lmcache_mp.cli', run_name='__main__')\n"
             "except SystemExit as exc:\n"
             "    print('exit', exc.code, 'torch' in sys.modules, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    expected_code = 2 if argv[0] == "--cpu-size" else 0
    assert done.stderr.splitlines()[-1] == f"exit {expected_code} False", done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_gpu_tier_needs_cuda(capsys):
    assert Config.from_args([], env={}).gpu_size == 0
    assert Config.from_args([], env={"LMCACHE_MP_GPU_SIZE": "0"}).gpu_size == 0
    for argv, env in ((["--gpu-size", "1GiB"], {}), ([], {"LMCACHE_MP_GPU_SIZE": "8GiB"})):
        with pytest.raises(SystemExit) as exit_info:
            Config.from_args(argv, env=env)
        assert exit_info.value.code == 2
        assert "--gpu-size needs CUDA, and this server has none" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--host", "0.0.0.0"], ["--url", "tcp://*:5555"],
                                  ["--url", "tcp://[::]:5555"], ["--host", "10.1.2.3"]])
def test_binding_beyond_loopback_needs_a_token_file(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args(argv, env={})
    assert exit_info.value.code == 2
    assert "--token-file" in capsys.readouterr().err
    for loopback in (["--host", "127.0.0.1"], ["--url", "tcp://localhost:5555"],
                     ["--url", "tcp://[::1]:5555"]):
        Config.from_args(loopback, env={})
    Config.from_args([*argv, "--token-file", "/etc/lmcache-mp/token"], env={})


def test_chunks_per_message_cannot_exceed_the_protocol_limit(capsys):
    with pytest.raises(SystemExit):
        Config.from_args(["--max-chunks-per-message", str(MAX_CHUNKS_PER_MESSAGE + 1)], env={})
    assert f"at most {MAX_CHUNKS_PER_MESSAGE}" in capsys.readouterr().err


def test_a_disk_key_file_needs_a_disk_dir_and_must_lie_outside_it(tmp_path, capsys):
    """Beside the disk directory is where it belongs (its parent holding both); the
    directory itself, or anything below it, is refused, as is a key without a tier."""
    disk = ["--disk-dir", str(tmp_path / "state" / "disk"), "--disk-size", "1GiB"]
    beside = str(tmp_path / "state" / "disk.key")
    assert Config.from_args([*disk, "--disk-key-file", beside], env={}).disk_key_file == beside
    assert Config.from_args(disk, env={"LMCACHE_MP_DISK_KEY_FILE": beside}).disk_key_file \
        == beside
    assert Config.from_args(disk, env={}).disk_key_file is None
    for key, message in ((str(tmp_path / "state" / "disk"), "is inside --disk-dir"),
                         (str(tmp_path / "state" / "disk" / "sub" / ".." / "k"),
                          "is inside --disk-dir"),
                         (str(tmp_path / "state" / "disk" / "k"), "is inside --disk-dir")):
        with pytest.raises(SystemExit) as exit_info:
            Config.from_args([*disk, "--disk-key-file", key], env={})
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        Config.from_args(["--disk-key-file", beside], env={})
    assert "--disk-key-file needs --disk-dir" in capsys.readouterr().err
