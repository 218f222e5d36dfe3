"""`vllm-wna16`: every verb turns bad input and bad files into one line on stderr and exit status 2.

In-process through cli.main for make-checkpoint and doctor (no vLLM state); the demo's own cases,
which build vLLM layers, run in a subprocess in test_demo.py.
"""

from __future__ import annotations

import os

import pytest

from vllm_wna16_plugin.tools import make_checkpoint as mc
from vllm_wna16_plugin.tools.cli import DEBUG_ENV, EXIT_ERROR, build_parser, main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return mc.make_checkpoint(tmp_path_factory.mktemp("cli") / "ck", fmt="gptq", hidden=128, intermediate=128,
                              experts=4, top_k=2, layers=1)  # fmt: skip


def error_line(capsys, verb: str) -> str:
    """The one error line of the last command; fails on a traceback or more than one error line."""
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    lines = [line for line in (out + err).splitlines() if "error:" in line]
    assert len(lines) == 1, out + err
    assert lines[0] in err.splitlines(), "the error goes to stderr"
    assert lines[0].startswith(f"vllm-wna16 {verb}: error: "), lines[0]
    return lines[0]


def test_make_checkpoint_into_a_path_below_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "ck"
    assert main(["make-checkpoint", str(target), "--format", "gptq"]) == EXIT_ERROR
    line = error_line(capsys, "make-checkpoint")
    assert str(tmp_path / "file") in line and "Not a directory" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into a read-only directory")
def test_make_checkpoint_into_a_read_only_directory(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(["make-checkpoint", str(ro / "ck"), "--format", "gptq"]) == EXIT_ERROR
    finally:
        ro.chmod(0o700)
    assert "Permission denied" in error_line(capsys, "make-checkpoint")


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(["--format", "awq", "--bits", "8"],
                     "--format awq with --bits 8: AWQ GEMM checkpoints are 4-bit only; use --format gptq or "
                     "--format compressed-tensors for 8-bit", id="awq-int8"),
        pytest.param(["--format", "gptq", "--group-size", "48"],
                     "--group-size 48 does not divide --hidden 256; use a divisor of both --hidden and "
                     "--intermediate, or --group-size -1 (channel-wise)", id="group-size"),
        pytest.param(["--format", "gptq", "--top-k", "9"],
                     "need --experts >= 1 and 1 <= --top-k <= --experts, got --experts 8, --top-k 9", id="top-k"),
        pytest.param(["--format", "awq", "--desc-act"], "--desc-act applies to --format gptq (desc_act) and --format "
                     "compressed-tensors (actorder: group) only, not --format awq", id="desc-act"),
        pytest.param(["--format", "compressed-tensors", "--group-size-null"],
                     "--group-size-null writes a channel-wise compressed-tensors config; it needs --format "
                     "compressed-tensors and --group-size -1, got --format compressed-tensors, --group-size 128",
                     id="group-size-null"),
        pytest.param(["--format", "awq", "--checkpoint-format", "gptq_v2"],
                     "--checkpoint-format gptq_v2 applies to --format gptq only", id="checkpoint-format"),
        pytest.param(["--format", "gptq", "--vocab-size", "100"],
                     "--vocab-size 100 is smaller than the tokenizer's 512 tokens", id="vocab-size"),
        pytest.param(["--format", "gptq", "--hidden", "100"], "--hidden 100 must be a positive multiple of 32",
                     id="hidden"),
    ],
)  # fmt: skip
def test_make_checkpoint_errors_name_the_flags_typed(tmp_path, capsys, argv, message):
    assert main(["make-checkpoint", str(tmp_path / "ck"), *argv]) == EXIT_ERROR
    assert error_line(capsys, "make-checkpoint") == f"vllm-wna16 make-checkpoint: error: {message}"
    assert not (tmp_path / "ck" / "config.json").exists()


def test_make_checkpoint_python_api_names_the_arguments(tmp_path):
    # the same rule, spelled as the Python caller wrote it
    with pytest.raises(ValueError, match=r"^group_size=48 does not divide hidden=256; .* or group_size=-1"):
        mc.make_checkpoint(tmp_path, fmt="gptq", group_size=48)


def test_make_checkpoint_module_entry_point_is_the_cli(tmp_path, capsys):
    assert mc.main([str(tmp_path / "ck"), "--format", "awq", "--bits", "8"]) == EXIT_ERROR
    assert "--format awq with --bits 8" in error_line(capsys, "make-checkpoint")


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param("missing-dir", id="missing-dir"),
        pytest.param("broken-json", id="broken-json"),
        pytest.param("config-is-a-directory", id="config-is-a-directory"),
    ],
)
def test_doctor_bad_checkpoint_directory_is_one_line(tmp_path, capsys, checkpoint, breakage):
    model = tmp_path / "model"
    if breakage != "missing-dir":
        model.mkdir()
    if breakage == "broken-json":
        text = (checkpoint / "config.json").read_text()
        (model / "config.json").write_text(text[: len(text) // 2])  # cut mid-file
    if breakage == "config-is-a-directory":
        (model / "config.json").mkdir()
    status = main(["doctor", str(model)])
    out, err = capsys.readouterr()
    assert status != 0
    assert "Traceback" not in out + err
    lines = [line for line in (out + err).splitlines() if "error:" in line]
    assert len(lines) == 1 and "config.json" in lines[0], out + err


def test_debug_env_shows_the_traceback(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(OSError):
        main(["make-checkpoint", str(tmp_path / "file" / "ck"), "--format", "gptq"])


def test_help_documents_exit_status_and_debug_switch(capsys):
    for verb in ([], ["demo"], ["doctor"], ["make-checkpoint"]):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([*verb, "--help"])
        assert exit_.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "exit status: 0 success; 1" in text and f"{DEBUG_ENV}=1" in text, verb


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["make-checkpoint", "out", "--format", "exl2"])
    assert exit_.value.code == EXIT_ERROR
    assert "invalid choice: 'exl2'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, verb",
    [
        (["make-checkpoint", "out", "--format", "exl2"], "make-checkpoint"),
        (["doctor"], "doctor"),
        (["doctor", "d", "--tp", "two"], "doctor"),
        (["doctor", "d", "--frob"], "doctor"),
        (["frobnicate"], None),
        ([], None),
    ],
)
def test_usage_errors_are_one_line_naming_the_verb(capsys, argv, verb):
    """argparse's usage block and error were 2-14 lines; the epilog promises one (a bad-input sweep)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == EXIT_ERROR
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    prog = "vllm-wna16" + (f" {verb}" if verb else "")
    assert err.startswith(f"{prog}: error: ") and err.strip().endswith(f"(see {prog} --help)"), err


def test_make_checkpoint_never_writes_into_another_models_directory(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "model.safetensors.index.json").write_text("{}")
    assert main(["make-checkpoint", str(other), "--format", "gptq"]) == EXIT_ERROR
    line = error_line(capsys, "make-checkpoint")
    assert "files that vllm-wna16 make-checkpoint did not write" in line and "--force" in line
    assert (other / "config.json").read_text() == "{}"
    assert main(["make-checkpoint", "", "--format", "gptq"]) == EXIT_ERROR
    assert "OUT is empty" in error_line(capsys, "make-checkpoint")
    # its own earlier output, an empty directory, and --force are written
    ours = tmp_path / "ours"
    for _ in range(2):
        assert main(["make-checkpoint", str(ours), "--format", "gptq", "--hidden", "128", "--intermediate", "128",
                     "--experts", "2", "--layers", "1"]) == 0  # fmt: skip
    assert main(["make-checkpoint", str(other), "--format", "awq", "--hidden", "128", "--intermediate", "128",
                 "--experts", "2", "--layers", "1", "--force"]) == 0  # fmt: skip
    capsys.readouterr()


def test_make_checkpoint_seed_out_of_range_names_the_flag(tmp_path, capsys):
    assert main(["make-checkpoint", str(tmp_path / "ck"), "--format", "gptq", "--seed", str(2**70)]) == EXIT_ERROR
    assert "--seed 1180591620717411303424 is out of range" in error_line(capsys, "make-checkpoint")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("value, shown", [("false", False), ("off", False), ("0", False), ("yes", True), ("1", True)])
def test_debug_switch_reads_the_usual_spellings(value, shown):
    from vllm_wna16_plugin.tools.cli import debug_on

    assert debug_on({DEBUG_ENV: value}) is shown


def test_a_reader_that_stops_early_ends_the_command_quietly(checkpoint):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "vllm_wna16_plugin.tools.cli", "doctor", str(checkpoint)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    proc.stdout.read(10)
    proc.stdout.close()  # `| head -c 10`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "error" not in err, err


@pytest.mark.parametrize("value", ["maybe", "2", "debug"])
def test_a_debug_switch_of_another_value_is_one_line_naming_it(tmp_path, monkeypatch, capsys, value):
    """VLLM_WNA16_DEBUG=maybe (or 2) was read as on: a silent guess (a bad-input sweep). Now refused by name, before
    the verb runs, with the values that work."""
    from vllm_wna16_plugin.tools.cli import debug_on

    with pytest.raises(ValueError, match=rf"^{DEBUG_ENV}='{value}' is not understood; use 1 .* or 0"):
        debug_on({DEBUG_ENV: value})
    monkeypatch.setenv(DEBUG_ENV, value)
    assert main(["make-checkpoint", str(tmp_path / "ck"), "--format", "gptq"]) == EXIT_ERROR
    assert f"{DEBUG_ENV}='{value}' is not understood" in error_line(capsys, "make-checkpoint")
    assert not (tmp_path / "ck").exists()
