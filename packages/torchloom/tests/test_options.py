"""LoomOptions: validation, env layering, modes."""

from __future__ import annotations

import dataclasses
import logging
import typing
from typing import Any

import pytest

from torchloom import MODES, LoomOptions, LoomOptionsError, resolve_options


def test_defaults_are_inductor_codegen_and_not_strict() -> None:
    opts = resolve_options(env={})
    assert opts.codegen == "inductor"
    assert opts.strict is False


def test_unknown_key_names_the_key_and_lists_valid_ones() -> None:
    with pytest.raises(LoomOptionsError) as err:
        resolve_options(options={"codegn": "eager"}, env={})
    msg = str(err.value)
    assert "'codegn'" in msg
    for field in dataclasses.fields(LoomOptions):
        assert field.name in msg


def test_wrong_type_names_the_key_and_expected_type() -> None:
    with pytest.raises(LoomOptionsError, match=r"'strict'.*expected bool"):
        resolve_options(options={"strict": "yes"}, env={})
    with pytest.raises(LoomOptionsError, match=r"'codegen'.*'inductor' \| 'eager'"):
        resolve_options(options={"codegen": "triton"}, env={})


def test_environment_sets_options_and_compile_arguments_win() -> None:
    env = {"TORCHLOOM_CODEGEN": "eager", "TORCHLOOM_STRICT": "1"}
    assert resolve_options(env=env) == LoomOptions(codegen="eager", strict=True)
    assert resolve_options(options={"codegen": "inductor"}, env=env).codegen == "inductor"


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(LoomOptionsError, match="TORCHLOOM_STRICT"):
        resolve_options(env={"TORCHLOOM_STRICT": "maybe"})
    with pytest.raises(LoomOptionsError, match="TORCHLOOM_CODEGEN"):
        resolve_options(env={"TORCHLOOM_CODEGEN": "triton"})


def test_every_option_has_an_environment_variable() -> None:
    for field in dataclasses.fields(LoomOptions):
        default = getattr(LoomOptions(), field.name)
        raw = {bool: "1" if not default else "0", int: "7", float: "0.5", str: str(default)}
        value = raw.get(type(default), str(default))
        opts = resolve_options(env={f"TORCHLOOM_{field.name.upper()}": value})
        assert isinstance(getattr(opts, field.name), type(default))


def test_reduce_overhead_mode_is_the_cudagraphs_option() -> None:
    assert resolve_options(mode="reduce-overhead", env={}).cudagraphs is True
    assert resolve_options(options={"cudagraphs": True}, env={}) == resolve_options(
        mode="reduce-overhead", env={}
    )
    assert set(MODES) >= {"default", "reduce-overhead"}


def test_unknown_mode_lists_valid_modes() -> None:
    with pytest.raises(LoomOptionsError, match="reduce-overhead"):
        resolve_options(mode="turbo", env={})


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        LoomOptions().codegen = "eager"  # type: ignore[misc]


def _two_values(name: str) -> tuple[Any, Any, str, str]:
    """Two distinct valid values of one option, with their environment spellings."""
    default = getattr(LoomOptions(), name)
    tp = typing.get_type_hints(LoomOptions)[name]
    if typing.get_origin(tp) is typing.Literal:
        a, b = typing.get_args(tp)[:2]
        return a, b, str(a), str(b)
    if isinstance(default, bool):
        return True, False, "1", "0"
    return 3, 4, "3", "4"


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(LoomOptions)])
def test_each_option_precedence_is_defaults_env_mode_options(name: str) -> None:
    a, b, env_a, _ = _two_values(name)
    var = f"TORCHLOOM_{name.upper()}"
    assert getattr(resolve_options(env={var: env_a}), name) == a  # env beats the default
    assert getattr(resolve_options(options={name: b}, env={var: env_a}), name) == b
    for mode, implied in MODES.items():
        if name in implied:  # mode beats env; options beat mode
            flipped = not implied[name]
            env = {var: "1" if flipped else "0"}
            assert getattr(resolve_options(mode=mode, env=env), name) == implied[name]
            got = resolve_options(mode=mode, options={name: flipped}, env=env)
            assert getattr(got, name) == flipped


def test_cache_env_off_loses_to_options_on_in_the_cache_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    import torchloom

    monkeypatch.setenv("TORCHLOOM_CACHE", "0")
    torchloom.reset()
    f = torch.compile(
        lambda x: x.cos() * 5, backend="loom", options={"codegen": "eager", "cache": True}
    )
    f(torch.randn(3))
    kinds = [e.kind for e in torchloom.report().entries("cache")]
    assert kinds == ["miss", "stored"]
    torch._dynamo.reset()
    torchloom.reset()
    g = torch.compile(lambda x: x.cos() * 6, backend="loom", options={"codegen": "eager"})
    g(torch.randn(3))
    (bypass,) = torchloom.report().entries("cache")
    assert bypass.kind == "bypass" and "off" in bypass.message


def test_cudagraph_or_error_env_loses_to_options_in_the_cudagraph_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torchloom._cudagraph import cudagraph_options

    monkeypatch.setenv("TORCHLOOM_CUDAGRAPH_OR_ERROR", "1")

    def stage_options(**options: Any) -> bool:
        return cudagraph_options(resolve_options(options=options)).or_error

    assert stage_options() is True
    assert stage_options(cudagraph_or_error=False) is False


@pytest.mark.parametrize(
    ("name", "value", "least"),
    [
        ("cudagraph_max_recording", -1, 0),
        ("cudagraph_max_shapes", -3, 0),
        ("saved_tensor_hooks_variants", -1, 0),
    ],
)
def test_numbers_out_of_range_are_refused(name: str, value: int, least: int) -> None:
    with pytest.raises(
        LoomOptionsError, match=rf"'{name}' from options= got {value}; it must be at least {least}"
    ):
        resolve_options(options={name: value}, env={})
    var = f"TORCHLOOM_{name.upper()}"
    with pytest.raises(LoomOptionsError, match=var):
        resolve_options(env={var: str(value)})
    assert getattr(resolve_options(options={name: least}, env={}), name) == least


def test_a_misspelt_option_suggests_the_closest_name() -> None:
    with pytest.raises(LoomOptionsError, match="did you mean 'cudagraph_max_shapes'"):
        resolve_options(options={"cudagraph_max_shape": 2}, env={})


def test_a_misspelt_variable_warns_once_with_the_closest_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from torchloom import _options

    _options._warned.discard("TORCHLOOM_CUDAGRAPH_MAX_RECORDINGS")
    env = {
        "TORCHLOOM_CUDAGRAPH_MAX_RECORDINGS": "2",
        "TORCHLOOM_CACHE_DIR": "/somewhere",
        "TORCHLOOM_LOG": "info",
        # capture_step's own variables (resolved by torchloom.capture_step) are known
        "TORCHLOOM_CAPTURE_STEP_WARMUP": "2",
        "TORCHLOOM_CAPTURE_STEP_MAX_RECORDINGS": "2",
    }
    caplog.set_level(logging.WARNING, logger="torchloom.options")
    resolve_options(env=env)
    resolve_options(env=env)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "TORCHLOOM_CUDAGRAPH_MAX_RECORDINGS" in warning
    assert "did you mean 'TORCHLOOM_CUDAGRAPH_MAX_RECORDING'" in warning


def test_cudagraphs_without_cuda_warns_once_and_is_not_an_error(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from torchloom import _options

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _options._warned.discard("cudagraphs")
    caplog.set_level(logging.WARNING, logger="torchloom.options")
    assert resolve_options(mode="reduce-overhead", env={}).cudagraphs
    assert resolve_options(options={"cudagraphs": True}, env={}).cudagraphs
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "without CUDA" in warning
