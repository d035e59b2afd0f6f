"""hardware/presets.py: analytical profiles say so, in their label, their table and their file."""

from __future__ import annotations

from wrapopt.hardware.presets import analytical_fabric
from wrapopt.hardware.profiles import FabricProfile
from wrapopt.report.fabric import format_fabric


def test_analytical_profile_is_labelled_everywhere(tmp_path) -> None:
    fabric = analytical_fabric("h100-nvlink-ib400", world_size=16)
    assert fabric.kind == "analytical" and "analytical" in fabric.label
    text = format_fabric(fabric)
    assert text.splitlines()[0] == "fabric h100-nvlink-ib400: ANALYTICAL (stated numbers, not measured)"
    assert "MEASURED" not in text and "ring model, analytical" in text
    path = tmp_path / "a.json"
    fabric.save(str(path))
    assert FabricProfile.load(str(path)).kind == "analytical"


# -- issue 35: GPU and network presets chosen apart, stated files, bad input --------------------

import json  # noqa: E402

import pytest  # noqa: E402

from wrapopt.errors import ProfileError  # noqa: E402
from wrapopt.hardware.catalog import GPU_TEMPLATE, GPUS, INTER_LINKS, INTRA_LINKS  # noqa: E402
from wrapopt.hardware.presets import FABRIC_PAIRS, NETWORK_TEMPLATE, TEMPLATE, analytical_compute  # noqa: E402
from wrapopt.hardware.resolve import fabric_name, resolve_fabric  # noqa: E402


def test_named_fabrics_are_gpu_network_pairs() -> None:
    for name, (gpu, net) in FABRIC_PAIRS.items():
        named = analytical_fabric(name, world_size=16)
        pair = analytical_fabric(gpu=gpu, network=net, world_size=16)
        assert named.name == name and (named.intra, named.inter) == (pair.intra, pair.inter)
        assert named.meta["compute"] == pair.meta["compute"]
    # a bare inter-node name takes the GPU's own link inside the node
    a100 = analytical_fabric(gpu="a100-40gb-sxm", network="ib400", world_size=16)
    assert a100.intra == INTRA_LINKS["nvlink3"] and a100.inter == INTER_LINKS["ib400"]
    assert resolve_fabric("h200+nvlink4-roce400", world_size=16, ranks_per_node=8).inter == INTER_LINKS["roce400"]
    assert fabric_name(fabric=None, gpu="h100-nvl", network="ib200") == "h100-nvl+ib200"


def test_every_constant_names_its_source() -> None:
    for g in GPUS.values():
        assert "datasheet" in g.source and g.fit_source and g.num_sms > 0
        assert 0 < g.matmul_fraction <= 1 and 0 < g.attention_fraction <= 1
        c = analytical_compute(g.name, dtype="bfloat16")
        assert c.matmul_flops_per_s == pytest.approx(g.peak_flops_per_s["bfloat16"] * g.matmul_fraction)
        assert c.attention_flops_per_s == pytest.approx(g.peak_flops_per_s["bfloat16"] * g.attention_fraction)
    for link in (*INTRA_LINKS.values(), *INTER_LINKS.values()):
        assert link.source and link.bandwidth_bytes_per_s > 0


@pytest.mark.parametrize("name, listed", [("x100", "h100-sxm"), ("h100-sxm+ib300", "ib400"),
                                          ("b200+ib400", "a100-80gb-sxm")])
def test_unknown_preset_lists_the_ones_that_exist(name, listed) -> None:
    with pytest.raises(ProfileError, match=listed):
        resolve_fabric(name, world_size=8, ranks_per_node=8)


def test_stated_gpu_and_network_files_replace_either_side(tmp_path) -> None:
    gpu, net = tmp_path / "gpu.json", tmp_path / "net.json"
    gpu.write_text(json.dumps({**GPU_TEMPLATE, "matmul_fraction": 0.5}))
    net.write_text(json.dumps({**NETWORK_TEMPLATE, "inter_node": {"bandwidth_bytes_per_s": 5e9, "latency_s": 2e-5}}))
    f = resolve_fabric(f"{gpu}+{net}", world_size=16, ranks_per_node=8)
    assert f.inter.bandwidth_bytes_per_s == 5e9 and f.meta["compute"]["achievable_fraction"] == 0.5
    assert resolve_fabric(f"{gpu}+ib200", world_size=16, ranks_per_node=8).inter == INTER_LINKS["ib200"]
    assert resolve_fabric(f"h200+{net}", world_size=16, ranks_per_node=8).meta["gpu"] == "h200"


@pytest.mark.parametrize("template, field, unit", [
    (GPU_TEMPLATE, "hbm_bytes_per_s", "bytes/s"), (GPU_TEMPLATE, "memory_capacity_bytes", "bytes"),
    (GPU_TEMPLATE, "matmul_fraction", "fraction"), (TEMPLATE, "memory_bandwidth_bytes_per_s", "bytes/s"),
    (TEMPLATE, "gpus_per_node", "GPUs"), (NETWORK_TEMPLATE, "gpus_per_node", "GPUs")])
def test_stated_file_with_a_missing_or_negative_field_names_it_and_its_unit(tmp_path, template, field, unit) -> None:
    path = tmp_path / "stated.json"
    for bad in ({k: v for k, v in template.items() if k != field}, {**template, field: -1}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ProfileError, match=rf"'{field}' \(.*{unit}") as e:
            resolve_fabric(str(path), world_size=8, ranks_per_node=8)
        assert str(path) in str(e.value)
    nested = {**TEMPLATE, "inter_node": {"bandwidth_bytes_per_s": -5.0, "latency_s": 1e-5}}
    path.write_text(json.dumps(nested))
    with pytest.raises(ProfileError, match=r"inter_node: field 'bandwidth_bytes_per_s' \(bytes/s"):
        resolve_fabric(str(path), world_size=8, ranks_per_node=8)


def test_gpu_and_network_flags_name_a_pair_and_refuse_unknown_names() -> None:
    assert fabric_name(fabric=None, gpu="a100", network=None) == "a100"
    assert fabric_name(fabric="x.json", gpu=None, network=None) == "x.json"
    with pytest.raises(ProfileError, match="h100-nvl"):
        fabric_name(fabric=None, gpu="b200", network="ib400")
    with pytest.raises(ProfileError, match="roce400"):
        fabric_name(fabric=None, gpu="h100", network="ib300")
    with pytest.raises(ProfileError, match="not both"):
        fabric_name(fabric="h100-nvlink-ib400", gpu="h100", network=None)


# -- issue 49: the tables keep datasheet figures apart from fitted constants -------------------


def test_fitted_constants_name_their_rows_apart_from_the_datasheet() -> None:
    from wrapopt.hardware.catalog import BUSBW_ACHIEVED, Datasheet, Fitted

    for g in GPUS.values():
        assert isinstance(g.datasheet, Datasheet) and isinstance(g.fitted, Fitted)
        assert "datasheet" in g.datasheet.source and "rows" in g.fitted.fitted_on
        assert (g.matmul_fraction, g.attention_fraction) == (g.fitted.matmul_fraction, g.fitted.attention_fraction)
    # a GPU without published rows says whose constants it carries
    assert "H100 SXM" in GPUS["h200"].fitted.fitted_on and GPUS["h200"].fitted.matmul_fraction == 0.593
    refit = GPUS["h100-sxm"].with_fitted(matmul_fraction=0.5, attention_fraction=0.25)
    assert refit.fitted.fitted_on == GPUS["h100-sxm"].fitted.fitted_on and refit.datasheet is GPUS["h100-sxm"].datasheet
    assert refit.compute_spec()["achievable_fraction"] == 0.5 and GPUS["h100-sxm"].matmul_fraction == 0.593
    # links: the stated line rate at the busbw convention, shared by the GPUs behind one NIC
    assert INTRA_LINKS["nvlink4"].bandwidth_bytes_per_s == 450e9 * BUSBW_ACHIEVED == 360e9
    assert INTER_LINKS["eth100"].bandwidth_bytes_per_s == 12.5e9 * BUSBW_ACHIEVED / 8
