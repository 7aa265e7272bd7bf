"""LoomOptions: validation, env layering, modes."""

from __future__ import annotations

import dataclasses

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
