"""The dflash-jax command on the embedded models."""

from dflash_jax import cli


def test_generate_command(capsys):
    cli.main(["generate", "def fibonacci(n):", "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):")
    assert "identical to autoregressive" in out and "tau" in out and "tokens/s" in out


def test_bench_command_small(capsys):
    cli.main(["bench", "--new-tokens", "32", "--prompts", "2"])
    out = capsys.readouterr().out
    assert "AR tok/s" in out and "speedup" in out and "r =" in out


def test_bench_nvfp4_small(capsys):
    cli.main(["bench", "--nvfp4", "--new-tokens", "32", "--prompts", "2"])
    out = capsys.readouterr().out
    assert "nvfp4 no-scale" in out and "nvfp4 tok/s" in out
