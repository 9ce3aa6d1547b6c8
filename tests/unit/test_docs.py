"""The README and the docs hold what they say: a README of at most 250 lines; every relative link and anchor
resolves; every script, tool and benchmark the README names exists; the flags it names are the parser's, and its
"three flags" added to a Megatron-LM command parse into the offload it describes."""

import re
import shlex
from pathlib import Path

import pytest

from megatron.training.args.arguments import build_parser, declared_actions, parse_args

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = [README, REPO / "CONTRIBUTING.md", REPO / "docs" / "user_guide.md", REPO / "docs" / "flags.md",
        REPO / "docs" / "design.md", REPO / "docs" / "hf_checkpoints.md", REPO / "examples" / "slurm" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slugs(path: Path) -> set:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered)."""
    seen, out, fenced = {}, set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6} (.*)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def test_readme_is_at_most_250_lines():
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in slugs(file):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.relative_to(REPO)}: {broken}"


def test_the_scripts_and_benchmarks_the_readme_names_exist():
    text = README.read_text()
    named = set(re.findall(r"\b((?:examples|tools|tests|benchmarks)/[\w./-]+\.(?:sh|py|sbatch|md))", text))
    assert {"examples/one_gpu.sh", "examples/one_node.sh", "examples/slurm/multi_node.sbatch",
            "tools/plan_offload.py"} <= named
    experiments = set(re.findall(r"benchmarks/run_gpu\.sh (\w+)", text))
    assert len(experiments) >= 5  # the performance rows' commands
    missing = [p for p in named if not (REPO / p).exists()]
    missing += [f"benchmarks/experiments/{name}.sh" for name in experiments
                if not (REPO / "benchmarks" / "experiments" / f"{name}.sh").exists()]
    assert not missing, missing


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_flags_the_readme_names_are_the_parsers():
    text = README.read_text()
    known = {s for a in declared_actions(build_parser()) for s in a.option_strings}
    named = set(re.findall(r"`(--[A-Za-z0-9-]+)", _section(text, "The flags that matter")))
    named |= set(re.findall(r"`(--[A-Za-z0-9-]+)", _section(text, "Checkpoints, resume and conversion")))
    assert len(named) >= 12
    # --offload-NAME-path is parsed outside argparse (test_flag_reference checks it)
    unknown = {f for f in named if f not in known and not re.fullmatch(r"--offload-[A-Za-z]+-path", f)}
    assert not unknown, unknown


def test_the_three_flags_turn_a_megatron_lm_command_into_an_offloaded_one():
    section = _section(README.read_text(), "Coming from Megatron-LM")
    block = section.split("```bash\n")[1].split("```")[0]
    added = shlex.split(block.replace("\\\n", " ").split("<your Megatron-LM flags>")[1].replace("$USER", "me"))
    megatron_lm = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
                   "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--device", "cuda"]
    plain = parse_args(megatron_lm)
    assert plain.offload_tiers is None and not plain.use_distributed_optimizer
    assert [a for a in added if a.startswith("--")] == ["--offload-tiers", "--offload-host-cache-gb",
                                                        "--offload-nvme-path"]
    args = parse_args(megatron_lm + added)
    assert args.offload_tiers == ["host", "nvme"] and args.offload_host_cache_gb == 64
    assert args.offload_paths == {"nvme": "/local/nvme/me"}
    assert args.use_distributed_optimizer  # "The distributed optimizer is implied."
    # The recommended GPU form named beside it replaces --offload-tiers and adds the gpu tier's size.
    gpu_form = re.search(r"`(--offload-tiers gpu[^`]*)`", section).group(1).split()
    args = parse_args(megatron_lm + added + gpu_form)
    assert args.offload_tiers == ["gpu", "host", "nvme"] and args.offload_gpu_cache_gb == "auto"
