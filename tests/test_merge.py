"""Parameter-group merging (task arithmetic) of looped models: exactness, groups, lambda
resolution, refusals and the ``looptool merge`` command."""

from __future__ import annotations

import copy
import re
from collections import Counter

import pytest
import torch
import transformers
from safetensors.torch import load_file
from typer.testing import CliRunner

import looptool
from looptool.cli import app
from looptool.posttrain.merge import (
    BLOCKS,
    KINDS,
    LambdaSpec,
    MergeError,
    group_sizes,
    merge,
    parameter_groups,
    parse_lambdas,
    read_merge_config,
    resolve_lambda,
)
from looptool.testing import tiny_config, tiny_model

PREFIX = looptool.PrefixLoop(window=(1, 3), budgets=(0, 1, 2))
RECURRENT = looptool.RecurrentLoop(recurrent=(1, 3), max_loops=3)
PLANS = {"prefix": PREFIX, "recurrent": RECURRENT}
runner = CliRunner()
_bases: dict[tuple[str, str], looptool.LoopedModel] = {}


def base_model(arch: str = "llama", plan: str = "prefix") -> looptool.LoopedModel:
    """A converted tiny model (cached; tests never modify it)."""
    if (arch, plan) not in _bases:
        _bases[arch, plan] = looptool.convert(tiny_model(arch), PLANS[plan])
    return _bases[arch, plan]


def expert_of(base: looptool.LoopedModel, seed: int, scale: float = 0.02) -> looptool.LoopedModel:
    """A copy of ``base`` whose every parameter (the zero-initialised gates too) is perturbed."""
    expert = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in expert.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return expert


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def tensors(model) -> dict[str, torch.Tensor]:
    out = dict(params(model))
    out.update(dict(model.named_buffers()))
    return out


def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))


def expected_group(name: str, start: int, stop: int) -> str:
    """The group of a Llama / Qwen3-MoE parameter, from its Hugging Face name (the test's
    independent oracle; the library itself never reads names)."""
    if name.startswith("loop."):
        return "loop.loop"
    if name == "model.embed_tokens.weight":
        return "input.embed_head"
    if name == "lm_head.weight":
        return "output.embed_head"
    if name == "model.norm.weight":
        return "output.norm"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    assert m, name
    layer, rest = int(m[1]), m[2]
    block = "input" if layer < start else "looped" if layer < stop else "output"
    if "norm" in rest:
        kind = "norm"
    elif rest.startswith("mlp.gate."):
        kind = "router"
    elif rest.startswith("self_attn."):
        kind = "attention"
    else:
        kind = "mlp"
    return f"{block}.{kind}"


# ---------------------------------------------------------------------- groups
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("plan", ["prefix", "recurrent"])
def test_groups_follow_the_graph(arch, plan):
    model = base_model(arch, plan)
    groups = parameter_groups(model)
    assert set(groups) == set(params(model))
    assert groups == {n: expected_group(n, 1, 3) for n in groups}
    assert all(g.split(".")[0] in BLOCKS and g.split(".")[1] in KINDS for g in groups.values())
    loop_names = {n for n, _ in model.new_parameters()}
    assert loop_names and {n for n, g in groups.items() if g == "loop.loop"} == loop_names


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_groups_cover_every_parameter_once_per_family(arch):
    model = base_model(arch)
    groups = parameter_groups(model)
    total = sum(p.numel() for p in params(model).values())
    rows = group_sizes(model)
    for family in ("kind", "block", "block.kind"):
        fam = [r for r in rows if r[0] == family]
        assert sum(r[2] for r in fam) == len(groups), family
        assert sum(r[3] for r in fam) == total, family
    kinds = Counter(g.split(".")[1] for g in groups.values())
    blocks = Counter(g.split(".")[0] for g in groups.values())
    assert {r[1]: r[2] for r in rows if r[0] == "kind"} == dict(kinds)
    assert {r[1]: r[2] for r in rows if r[0] == "block"} == dict(blocks)
    if arch == "qwen3_moe":
        assert kinds["router"] == 4  # one router per layer
    else:
        assert "router" not in kinds
    assert kinds["norm"] > 0 and kinds["embed_head"] == 2 and blocks["looped"] > 0


# ---------------------------------------------------------------------- exactness
@pytest.mark.parametrize("arch,plan", [("llama", "prefix"), ("qwen3_moe", "recurrent")])
@pytest.mark.parametrize("spec", ["0", "attention=0", "0:looped.mlp=0"])
def test_zero_lambda_is_the_base_bit_for_bit(arch, plan, spec):
    base = base_model(arch, plan)
    expert = expert_of(base, seed=1)
    merged = merge(base, [expert], [spec])
    assert merged is not base
    want, got = tensors(base), tensors(merged)
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
        assert got[name].dtype == t.dtype
    assert all(got[n].data_ptr() != want[n].data_ptr() for n in params(base))  # a new model
    x = ids()
    for k in base.budgets:
        assert torch.equal(merged(x, budget=k).logits, base(x, budget=k).logits), k


@pytest.mark.parametrize("arch,plan", [("llama", "prefix"), ("qwen3_moe", "recurrent")])
def test_one_expert_at_lambda_one_is_that_expert_bit_for_bit(arch, plan):
    base = base_model(arch, plan)
    expert = expert_of(base, seed=2)
    merged = merge(base, [expert], 1.0)
    for name, t in params(expert).items():
        assert torch.equal(params(merged)[name], t), name
    # two experts, only the second selected: still exactly the second
    other = expert_of(base, seed=3)
    merged2 = merge(base, [other, expert], ["0:0", "1:1"])
    assert all(torch.equal(params(merged2)[n], t) for n, t in params(expert).items())
    x = ids()
    for k in base.budgets:
        assert torch.equal(merged(x, budget=k).logits, expert(x, budget=k).logits), k


def test_inputs_are_not_modified():
    base = base_model("llama")
    experts = [expert_of(base, seed=4), expert_of(base, seed=5)]
    before = [{n: t.clone() for n, t in params(m).items()} for m in (base, *experts)]
    merge(base, experts, ["0.3", "1:looped=0.7"])
    for snapshot, model in zip(before, (base, *experts)):
        assert all(torch.equal(params(model)[n], t) for n, t in snapshot.items())


@pytest.mark.parametrize(
    "arch,plan,specs,selected",
    [
        ("llama", "prefix", ["attention=1"], lambda g: g.endswith(".attention")),
        ("llama", "prefix", ["looped=1"], lambda g: g.startswith("looped.")),
        ("llama", "recurrent", ["looped.attention=0.3"], lambda g: g == "looped.attention"),
        ("llama", "recurrent", ["loop=0.5"], lambda g: g == "loop.loop"),
        ("llama", "prefix", ["norm=-0.5"], lambda g: g.endswith(".norm")),
        ("qwen3_moe", "prefix", ["0:router=0.5"], lambda g: g.endswith(".router")),
        (
            "qwen3_moe",
            "recurrent",
            ["output.mlp=0.25", "embed_head=0.75"],
            lambda g: g in ("output.mlp", "input.embed_head", "output.embed_head"),
        ),
    ],
)
def test_group_lambda_changes_exactly_that_group(arch, plan, specs, selected):
    base = base_model(arch, plan)
    expert = expert_of(base, seed=6)
    merged = merge(base, [expert], specs)
    groups = parameter_groups(base)
    parsed = parse_lambdas(specs, 1)
    b, e, m = params(base), params(expert), params(merged)
    changed = 0
    for name, group in groups.items():
        if not selected(group):
            assert torch.equal(m[name], b[name]), name
            continue
        lam = next(s.value for s in parsed if s.matches(group, 0))
        want = (b[name].double() + lam * (e[name].double() - b[name].double())).to(b[name].dtype)
        assert not torch.equal(m[name], b[name]), name
        torch.testing.assert_close(m[name], want, rtol=0, atol=1e-6)
        changed += 1
    assert changed > 0


def test_two_experts_at_one_half_are_their_mean():
    base = base_model("qwen3_moe")
    e0, e1 = expert_of(base, seed=7), expert_of(base, seed=8)
    merged = merge(base, [e0, e1], 0.5)
    p0, p1 = params(e0), params(e1)
    for name, t in params(merged).items():
        torch.testing.assert_close(t, (p0[name] + p1[name]) / 2, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- lambda specs
def _spec(text: str, n: int = 2) -> LambdaSpec:
    return parse_lambdas([text], n)[0]


def test_parse_lambdas_grammar():
    assert _spec("0.5") == LambdaSpec(0.5, None, None, "0.5")
    assert _spec("attention=1") == LambdaSpec(1.0, "attention", None, "attention=1")
    assert _spec("1:looped.attention=-0.25") == LambdaSpec(-0.25, "looped.attention", 1, "1:looped.attention=-0.25")
    assert _spec("0:0.7") == LambdaSpec(0.7, None, 0, "0:0.7")
    assert [s.specificity for s in parse_lambdas(["1", "mlp=1", "looped=1", "output.norm=1"], 1)] == [0, 1, 1, 2]


def test_resolution_most_specific_then_expert_then_last():
    def lam(specs, group, expert=0):
        return resolve_lambda(parse_lambdas(specs, 2), group, expert)

    assert lam(["attention=1"], "input.mlp") == 0.0  # unmatched groups keep the base
    assert lam(["0.2", "attention=0.5"], "input.attention") == 0.5  # a group over all
    assert lam(["attention=0.5", "0.2"], "input.attention") == 0.5  # regardless of order
    assert lam(["looped.attention=0.9", "attention=0.5", "looped=0.4"], "looped.attention") == 0.9
    assert lam(["attention=0.5", "looped=0.4"], "looped.attention") == 0.4  # kind vs block: the later
    assert lam(["looped=0.4", "attention=0.5"], "looped.attention") == 0.5
    assert lam(["0:attention=0.1", "attention=0.5"], "looped.attention", 0) == 0.1  # expert beats all
    assert lam(["0:attention=0.1", "attention=0.5"], "looped.attention", 1) == 0.5
    assert lam(["0:0.1", "attention=0.5"], "looped.attention", 0) == 0.5  # group specificity first
    assert lam(["loop=0.3"], "loop.loop") == 0.3
    assert lam(["looped=0.3"], "loop.loop") == 0.0


@pytest.mark.parametrize(
    "spec,message",
    [
        ("abc", "is not VALUE, GROUP=VALUE or EXPERT:GROUP=VALUE"),
        ("attention=", "is not VALUE"),
        ("=1", "unknown group ''"),
        ("x:attention=1", "is not VALUE"),
        ("0:1:attention=1", "is not VALUE"),
        ("attention=1=2", "is not VALUE"),
        ("inf", "not a finite number"),
        ("attn=1", "unknown group 'attn'"),
        ("looped.loop=1", "unknown group 'looped.loop'"),
        ("2:attention=1", "names expert 2, but there are 2 experts"),
    ],
)
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(MergeError, match=re.escape(message)) as info:
        parse_lambdas([spec], 2)
    assert str(info.value).count(". ") == 0 or "e.g." in str(info.value)  # one sentence


def test_no_spec_is_refused():
    with pytest.raises(MergeError, match="at least one lambda spec"):
        parse_lambdas([], 1)
    with pytest.raises(MergeError, match="at least one lambda spec"):
        merge(base_model(), [base_model()], [])


def test_unknown_group_lists_the_valid_ones():
    with pytest.raises(MergeError) as info:
        parse_lambdas(["ffn=1"], 1)
    assert all(name in str(info.value) for name in (*KINDS, *BLOCKS, "BLOCK.KIND"))


def test_empty_group_is_refused():
    base = base_model("llama")
    with pytest.raises(MergeError, match="'router', which holds no parameter of this model"):
        merge(base, [expert_of(base, seed=9)], ["router=0.5"])


# ---------------------------------------------------------------------- incompatible experts
def _llama(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config("llama")
    for key, value in overrides.items():
        setattr(config, key, value)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_other_architecture_is_refused():
    with pytest.raises(MergeError, match="is a qwen3_moe model .* the base a llama model"):
        merge(base_model("llama"), [base_model("qwen3_moe")], 0.5)


def test_other_plan_is_refused():
    base = base_model("llama")
    with pytest.raises(MergeError, match="merge only models converted with the same plan"):
        merge(base, [base_model("llama", "recurrent")], 0.5)
    other = looptool.convert(tiny_model("llama"), looptool.PrefixLoop(window=(1, 3), budgets=(0, 2)))
    with pytest.raises(MergeError, match="same plan"):
        merge(base, [other], 0.5)


def test_other_parameters_are_refused():
    base = base_model("llama")
    wider = looptool.convert(_llama(intermediate_size=96), PREFIX)
    with pytest.raises(MergeError, match=r"has shape \(96, 64\) in expert 0 but \(128, 64\) in the base"):
        merge(base, [wider], 0.5)
    biased = looptool.convert(_llama(attention_bias=True), PREFIX)
    with pytest.raises(MergeError, match="has parameters the base lacks"):
        merge(base, [biased], 0.5, labels=["the biased one"])


def test_expert_index_out_of_range_is_refused():
    base = base_model("llama")
    with pytest.raises(MergeError, match="names expert 1, but there is 1 expert"):
        merge(base, [expert_of(base, seed=10)], ["1:attention=0.5"])
    with pytest.raises(MergeError, match="names expert 3"):
        merge(base, [base], [LambdaSpec(0.5, "mlp", 3)])


# ---------------------------------------------------------------------- command line
def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Base and two experts (converted, perturbed in place, saved) as model directories;
    ``root.models`` holds the in-memory models."""
    root = tmp_path_factory.mktemp("merge")
    base = looptool.convert(tiny_model("qwen3_moe"), PREFIX)
    base.save_pretrained(root / "base")
    gen = torch.Generator().manual_seed(11)
    experts = []
    for j in range(2):
        expert = looptool.convert(tiny_model("qwen3_moe"), PREFIX)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        expert.save_pretrained(root / f"e{j}")
        experts.append(expert)
    _models[root] = (base, experts)
    return root


_models: dict = {}


def test_cli_merge_end_to_end(saved, tmp_path):
    out = tmp_path / "merged"
    specs = ["0.5", "1:looped=1", "0:router=0.25"]
    res = _run(
        "merge", saved / "base", saved / "e0", saved / "e1", "-o", out, *(a for s in specs for a in ("--lambda", s))
    )
    assert res.exit_code == 0, res.output
    assert "saved merged model to" in res.output and "looped.router" in res.output
    reloaded = looptool.load(out)
    base, experts = _models[saved]
    in_memory = merge(base, experts, specs)
    for name, t in params(in_memory).items():
        assert torch.equal(params(reloaded)[name], t), name
    x = ids()
    for k in reloaded.budgets:
        assert torch.equal(reloaded(x, budget=k).logits, in_memory(x, budget=k).logits), k
    # the merge's recipe is recorded beside it: experts in order, λ specs as given, λ per group
    config, recorded = read_merge_config(out)
    assert config["base"] == str(saved / "base") and config["experts"] == [str(saved / "e0"), str(saved / "e1")]
    assert [s["text"] for s in config["lambdas"]] == specs and recorded == parse_lambdas(specs, 2)
    assert config["lambda_by_group"]["looped.router"] == [0.25, 1.0] and config["lambda_by_group"]["input.mlp"] == [
        0.5,
        0.5,
    ]
    replayed = merge(base, experts, recorded)
    assert all(torch.equal(params(replayed)[n], t) for n, t in params(reloaded).items())
    res = _run("merge", saved / "base", saved / "e0", "-o", out, "--lambda", "1")
    assert res.exit_code == 1 and "already exists" in res.output  # --overwrite needed
    res = _run("merge", saved / "base", saved / "e0", "-o", out, "--lambda", "1", "--overwrite")
    assert res.exit_code == 0, res.output
    stored = load_file(out / "model.safetensors")
    assert all(torch.equal(stored[n], t) for n, t in params(experts[0]).items())


@pytest.mark.parametrize(
    "args,message",
    [
        (["--lambda", "attention=oops"], "is not VALUE, GROUP=VALUE"),
        (["--lambda", "ffn=1"], "unknown group 'ffn'"),
        (["--lambda", "3:mlp=1"], "names expert 3"),
        ([], "at least one lambda spec"),
    ],
)
def test_cli_bad_spec_exits_1_and_writes_nothing(saved, tmp_path, args, message):
    out = tmp_path / "merged"
    res = _run("merge", saved / "base", saved / "e0", "-o", out, *args)
    assert res.exit_code == 1
    assert message in res.output and res.output.count("error:") == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_refuses_incompatible_expert(saved, tmp_path):
    other = tmp_path / "llama"
    base_model("llama").save_pretrained(other)
    out = tmp_path / "merged"
    res = _run("merge", saved / "base", other, "-o", out, "--lambda", "0.5")
    assert res.exit_code == 1 and res.output.count("error:") == 1
    assert "expert 0" in res.output and "same architecture" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


def test_cli_list_groups(saved):
    res = _run("merge", saved / "base", "--list-groups")
    assert res.exit_code == 0, res.output
    model = _models[saved][0]
    for family, group, count, scalars in group_sizes(model):
        cells = rf"{re.escape(family)}[\s│]+{re.escape(group)}[\s│]+{count}[\s│]+{scalars:,}"
        assert re.search(cells, res.output), (family, group)
    res = _run("merge", saved / "base", saved / "e0", "--list-groups")
    assert res.exit_code == 1 and "--list-groups only reads BASE" in res.output
