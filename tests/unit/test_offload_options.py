"""The engine options' one table (``megatron.training.offload.options``) against independent references:
OffloadConfig's own fields and defaults, the parser pretrain_gpt.py builds, the units the flags' names
say (``-gb``: GiB, ``-mb``: MiB) and the precision-aware optimizer's own flags."""

from __future__ import annotations

import dataclasses
import re
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.training.args.arguments import build_parser, declared_actions, parse_args
from megatron.training.errors import UserError
from megatron.training.model.precision_aware import DTYPE_FLAGS
from megatron.training.offload.flags import config_from_args
from megatron.training.offload.options import (ERROR_NAMES, OPTIONS, PATH_FLAG_FORM, STATE_DTYPE_FLAGS, in_flags)
from megatron.training.offload.shard_budgets import config_for_kind
from mlp_offload import GiB, MiB, OffloadConfig
from tests.profiles import examples

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--device", "cpu"]
FILE_TIERS = ["--offload-tiers", "host,nvme", "--offload-nvme-path", "/x", "--offload-host-cache-gb", "64"]
CONFIG_FIELDS = {f.name for f in dataclasses.fields(OffloadConfig)}


def _offload_actions():
    return {s: a for a in declared_actions(build_parser()) for s in a.option_strings if s.startswith("--offload-")}


def _unit_named_by(flag: str) -> int:
    return GiB if flag.endswith("-gb") else MiB if flag.endswith("-mb") else 1


def test_each_option_fills_its_own_config_fields():
    filled = [o.field for o in OPTIONS if o.field]
    assert len(filled) == len(set(filled)) and set(filled) <= CONFIG_FIELDS
    assert set(ERROR_NAMES) <= CONFIG_FIELDS
    assert {o.flag for o in OPTIONS} == set(_offload_actions())  # the parser's offload flags are the table's
    assert all(o.unit == _unit_named_by(o.flag) for o in OPTIONS)


def test_every_flag_has_help_of_two_lines_stating_its_default_and_no_figures_of_runs():
    for flag, action in _offload_actions().items():
        assert 1 <= len(textwrap.wrap(action.help, 100)) <= 2, flag
        assert "Default:" in action.help, flag
        assert not re.search(r"H[0-9]00|[0-9]\.[0-9]+ ?(s|B|GiB|GB/s)\b|%", action.help), flag


def test_the_flags_defaults_give_the_config_defaults():
    """Where the parse decides no default of its own (the Adam kernel, per device), a flag left out
    leaves its field as OffloadConfig has it."""
    config = config_from_args(parse_args(BASE + ["--offload-tiers", "host"]), rank=0)
    reference = OffloadConfig(tiers=["host"])
    fields = [f for o in OPTIONS if o.field not in (None, "tiers", "adam_kernel")
              for f in (o.field, *(name for name, _ in o.error_names))]
    assert [f for f in fields if getattr(config, f) != getattr(reference, f)] == []


SIZED = [o for o in OPTIONS if o.field and o.metavar in ("N", "GB", "MB") and o.to_field is None]


@settings(max_examples=examples(60), deadline=None)
@given(st.data())
def test_a_sized_flag_fills_its_field_in_the_unit_its_name_says(data):
    chosen = data.draw(st.lists(st.sampled_from(SIZED), unique=True, min_size=1, max_size=4))
    argv, expected = FILE_TIERS[:4], {}  # the host budget among the flags drawn, else 64 GiB
    if "host_budget_bytes" not in {o.field for o in chosen}:
        argv += FILE_TIERS[4:]
    for option in chosen:
        value = (data.draw(st.integers(1, 64)) if option.metavar != "GB"
                 else data.draw(st.floats(1.0, 64.0).map(lambda x: round(x, 3))))
        argv += [option.flag, str(value)]
        expected[option.field] = int(value * _unit_named_by(option.flag))
    config = config_from_args(parse_args(BASE + argv), rank=0)
    assert {f: getattr(config, f) for f in expected} == expected


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.switch], ids=lambda o: o.flag)
def test_a_switch_turns_its_field_from_its_default(option):
    off = config_from_args(parse_args(BASE + ["--offload-tiers", "host"]), rank=0)
    on = config_from_args(parse_args(BASE + ["--offload-tiers", "host", option.flag]), rank=0)
    assert getattr(off, option.field) == OffloadConfig.__dataclass_fields__[option.field].default
    assert getattr(on, option.field) is (not getattr(off, option.field))
    assert option.flag.startswith("--offload-no-") == option.clears


@settings(max_examples=examples(60), deadline=None)
@given(st.sampled_from([o for o in SIZED if o.unit > 1]), st.integers(1, 10**6), st.integers(-3, 2))
def test_a_field_in_an_engine_message_reads_as_its_flag_and_a_value_that_flag_reads_back(option, mantissa, exponent):
    typed = mantissa * 10.0 ** exponent
    nbytes = int(typed * option.unit)
    line = in_flags(f"the value ({option.field}={nbytes}) is refused")
    flag, figure = re.fullmatch(r"the value \((\S+) (\S+)\) is refused", line).groups()
    assert flag == option.flag and int(float(figure) * option.unit) == nbytes


def test_keyed_fields_and_other_groups_flags_in_engine_messages():
    assert in_flags("paths['scratch2'] /x: gone") == "--offload-scratch2-path /x: gone"
    assert in_flags("token_scope['pfs'] is given") == "--offload-token-scope pfs is given"
    assert in_flags("(state_dtypes[1], state_dtypes[2])") == "(--exp-avg-dtype, --exp-avg-sq-dtype)"
    assert in_flags("needs param_remainders off") == "needs --no-store-param-remainders off"
    assert in_flags("device_adam_kernel and the paths and bandwidths in prose") == \
        "device_adam_kernel and the paths and bandwidths in prose"
    assert STATE_DTYPE_FLAGS == DTYPE_FLAGS
    options = {s for a in declared_actions(build_parser()) for s in a.option_strings}
    named = [n.flag.split()[0] for n in ERROR_NAMES.values() if n.say is None]
    named += [ERROR_NAMES["state_dtypes"].say(str(i)) for i in range(3)]
    assert set(named) <= options


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.needs_tiers and o.flag != PATH_FLAG_FORM],
                         ids=lambda o: o.flag)
def test_what_needs_tiers_is_refused_without_them_naming_the_flag(option):
    value = {"--offload-gpu-cache-gb": "auto", "--offload-update": "gpu", "--offload-token-scope": "pfs=job",
             "--offload-bandwidths": "nvme=1:1"}.get(option.flag, option.choices[-1] if option.choices else "1")
    with pytest.raises(UserError, match=f"^argument {option.flag}: requires --offload-tiers$"):
        parse_args(BASE + [option.flag, value])


def test_the_path_form_is_listed_and_refused_as_typed():
    assert PATH_FLAG_FORM in _offload_actions()
    with pytest.raises(UserError, match=f"^argument {PATH_FLAG_FORM}: NAME stands for a file tier"):
        parse_args(BASE + ["--offload-tiers", "host", PATH_FLAG_FORM, "/x"])
    assert parse_args(BASE + FILE_TIERS).offload_paths == {"nvme": "/x"}


def test_an_engine_config_is_one_step_from_the_ranks():
    whole = OffloadConfig(tiers=["host"], host_budget_bytes=10 * GiB, param_remainders=True)
    assert config_for_kind(whole, "dense", {"dense": 5}, param_remainders=True) is whole
    alone = config_for_kind(whole, "dense", {"dense": 5}, param_remainders=False)
    assert not alone.param_remainders and alone.host_budget_bytes == whole.host_budget_bytes
    experts = config_for_kind(whole, "experts", {"dense": 1, "experts": 1}, param_remainders=False)
    assert (experts.host_budget_bytes, experts.param_remainders) == (5 * GiB, False)
    assert experts.run_id == f"{whole.resolved_run_id()}.experts"
