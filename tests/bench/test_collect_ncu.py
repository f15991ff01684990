"""bench.collect_ncu without a GPU: its raw-page CSV parser on a hand-written fixture of
``ncu --csv --page raw`` output, the ncu command lines, and the driver walking its iterations on the CPU."""

from __future__ import annotations

import json
import sys

import pytest

from bench import collect_ncu
from bench.collect_ncu import (
    DRAM_READ, DURATION, L2_HIT_RATE, OCCUPANCY, nvtx_ranges, parse_raw_csv, short_name, summarise,
)
from diffspec.settings import BUNDLED_DRAFT, BUNDLED_TARGET

NVTX = "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
TAIL = ":none:none:none:none:none:none"


def _ranges(*names: str) -> str:
    """An NVTX cell as the csv module writes it: thread id, then one quoted entry per open range."""
    return "7  " + "  ".join(f'""<default domain>:{name}{TAIL}""' for name in names)


# Header, units, then one row per launch; what ncu prints before the header is skipped.
FIXTURE = "\n".join([
    "==PROF== Connected to process 4242 (/usr/bin/python3.12)",
    "==PROF== Profiling \"fused_layer_kernel\": 0%....50%....100% - 3 passes",
    f'"ID","Process ID","Process Name","Host Name","{NVTX}","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum",'
    '"l1tex__t_bytes.sum","lts__t_sector_hit_rate.pct","lts__t_sectors.sum",'
    '"sm__warps_active.avg.pct_of_peak_sustained_active"',
    '"","","","","","","","","","","","","Mbyte","Kbyte","us","Mbyte","%","sector","%"',
    f'"0","4242","python3.12","h200","{_ranges("auto step")}","void fused_layer_kernel<128>(float*, int)","1","7",'
    '"(128, 1, 1)","(132, 1, 1)","0","9.0","12.50","4.00","10.00","20.00","40.00","1,000","50.00"',
    f'"1","4242","python3.12","h200","{_ranges("auto step")}","void fused_layer_kernel<128>(float*, int)","1","7",'
    '"(128, 1, 1)","(132, 1, 1)","0","9.0","12.50","4.00","30.00","20.00","80.00","3,000","30.00"',
    f'"2","4242","python3.12","h200","{_ranges("diffspec step", "draft.propose", "aten::cat, seq = 12")}",'
    '"void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, 4>(...)","1","7","(256, 1, 1)",'
    '"(64, 1, 1)","0","9.0","1.00","1.00","2.00","3.00","n/a","0","25.00"',
    f'"3","4242","python3.12","h200","7 ","stray_kernel","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0",'
    '"0.00","0.00","1.00","0.00","0.00","0","1.00"',
])


def test_nvtx_cells_give_range_names_outermost_first():
    cell = '7  "<default domain>:diffspec step' + TAIL + '"  "<default domain>:aten::cat, seq = 3' + TAIL + '"'
    assert nvtx_ranges(cell) == ["diffspec step", "aten::cat"]
    assert nvtx_ranges("7 ") == []


def test_raw_page_rows_become_launches_in_base_units():
    launches = parse_raw_csv(FIXTURE)
    assert [(k.id, k.step, k.op) for k in launches] == [
        (0, "auto step", ""), (1, "auto step", ""), (2, "diffspec step", "aten::cat"), (3, None, "")]
    first = launches[0].metrics
    assert first[DRAM_READ] == 12.5e6 and first[DURATION] == 10_000.0
    assert first["dram__bytes_write.sum"] == 4_000.0 and first["lts__t_sectors.sum"] == 1000.0
    assert (first[L2_HIT_RATE], first[OCCUPANCY]) == (40.0, 50.0)
    assert launches[2].metrics[L2_HIT_RATE] is None  # "n/a"


def test_kernels_are_summed_per_step_and_op_with_weighted_rates():
    summaries = summarise(parse_raw_csv(FIXTURE))
    assert [(s.step, s.op, s.launches) for s in summaries] == [("auto step", "", 2), ("diffspec step", "aten::cat", 1)]
    layer, gather = summaries
    assert (layer.dram_read_bytes, layer.dram_write_bytes, layer.l1tex_bytes) == (25e6, 8e3, 40e6)
    assert layer.l2_hit_rate == pytest.approx(100 * (0.4 * 1000 + 0.8 * 3000) / 4000)  # 70%, by sectors
    assert layer.achieved_occupancy == pytest.approx((50 * 10 + 30 * 30) / 40)  # 35%, by time
    assert gather.l2_hit_rate is None and gather.unmeasured == [L2_HIT_RATE]
    table = collect_ncu.markdown(summaries, "# t")
    assert "## auto step: 1 kernels, 2 launches, 40.0 us of kernel time, 25.01 MB of HBM traffic" in table
    assert "| `fused_layer_kernel` | - | 2 | 40.0 | 70.0 | 25.000 | 0.008 | 40.000 | 35.0 |" in table
    assert "| `at::native::CatArrayBatchedCopy` | aten::cat | 1 |" in table


def test_short_names_drop_templates_and_arguments():
    assert short_name("void f<4, float>(int*)") == "f"
    assert short_name("void at::<unnamed>::indexSelectSmallIndex<float, long>(...)") == "at::indexSelectSmallIndex"
    assert short_name("ampere_bf16_s16816gemm_bf16_128x64") == "ampere_bf16_s16816gemm_bf16_128x64"


def test_a_csv_without_the_header_is_refused():
    with pytest.raises(ValueError, match="no ncu raw-page header"):
        parse_raw_csv("==ERROR== The application returned an error code (1).")


def _args(tmp_path, *extra: str):
    return collect_ncu.parser().parse_args([
        "--base-model", str(BUNDLED_TARGET), "--draft-model", str(BUNDLED_DRAFT), "--data", str(tmp_path / "d.jsonl"),
        "--context", "256", "--warm-steps", "2", "--out-dir", str(tmp_path / "ncu"), *extra])


def test_ncu_runs_the_driver_with_clock_control_none_then_exports_the_raw_page(tmp_path):
    args = _args(tmp_path, "--ncu", "/opt/ncu")
    profile, export = collect_ncu.ncu_commands("/opt/ncu", args.out_dir, collect_ncu.driver_argv(args))
    assert profile[:3] == ["/opt/ncu", "--clock-control", "none"] and "--nvtx" in profile
    assert profile[profile.index("--profile-from-start") + 1] == "off"
    assert profile[profile.index("--metrics") + 1].split(",") == list(collect_ncu.METRICS)
    inner = profile[profile.index("bench.collect_ncu") + 1:]
    assert inner[0] == "--driver" and "--ncu" not in inner
    assert collect_ncu.parser().parse_args(inner).warm_steps == 2
    assert collect_ncu.parser().parse_args(inner).steps == list(collect_ncu.STEP_RANGES)
    assert export == ["/opt/ncu", "--import", f"{tmp_path / 'ncu' / 'ncu_steps'}.ncu-rep", "--csv", "--page", "raw"]


def test_missing_ncu_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert collect_ncu.collect(_args(tmp_path)) == 2
    assert "no `ncu` on PATH" in capsys.readouterr().err


def test_the_driver_reaches_every_profiled_iteration(code_prompts, tmp_path):
    """On the CPU the profiler calls are skipped, but the iterations are walked as under ncu."""
    (tmp_path / "d.jsonl").write_text(code_prompts.read_text())
    assert collect_ncu.drive(_args(tmp_path, "--driver")) == 0
    driver = json.loads((tmp_path / "ncu" / "ncu_driver.json").read_text())
    assert driver["profiled"] == ["auto step", "diffspec start", "diffspec step"]
    assert driver["prompt_tokens"] == 256 and driver["device"] == "cpu"


def test_the_driver_profiles_only_the_steps_asked_for(code_prompts, tmp_path):
    (tmp_path / "d.jsonl").write_text(code_prompts.read_text())
    args = _args(tmp_path, "--steps", "auto step", "diffspec step")
    assert collect_ncu.driver_argv(args)[-3:] == ["--steps", "auto step", "diffspec step"]
    assert collect_ncu.drive(_args(tmp_path, "--driver", "--steps", "diffspec step")) == 0
    driver = json.loads((tmp_path / "ncu" / "ncu_driver.json").read_text())
    assert driver["profiled"] == ["diffspec step"]


FAKE_NCU = '''#!{python}
"""Stands in for ncu: the profiling call leaves the driver's JSON as the driver would, the import prints the fixture."""
import json, pathlib, sys
argv = sys.argv[1:]
if "--import" in argv:
    print(pathlib.Path({fixture!r}).read_text())
else:
    out = pathlib.Path(argv[argv.index("--out-dir") + 1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "ncu_driver.json").write_text(json.dumps({{"prompt_tokens": 256, "device": "fake", "profiled": ["auto step"]}}))
'''


def test_collect_writes_the_tables_from_what_ncu_exports(tmp_path, capsys):
    fixture = tmp_path / "raw.csv"
    fixture.write_text(FIXTURE)
    ncu = tmp_path / "fake-ncu"
    ncu.write_text(FAKE_NCU.format(python=sys.executable, fixture=str(fixture)))
    ncu.chmod(0o755)
    args = _args(tmp_path, "--ncu", str(ncu))
    assert collect_ncu.collect(args) == 0
    out = tmp_path / "ncu"
    written = json.loads((out / "ncu_kernels.json").read_text())
    assert [(k["step"], k["launches"]) for k in written["kernels"]] == [("auto step", 2), ("diffspec step", 1)]
    assert written["kernels"][0]["l2_hit_rate"] == pytest.approx(70.0)
    assert "| `fused_layer_kernel` | - | 2 |" in (out / "ncu_kernels.md").read_text()
    assert (out / "ncu_raw.csv").read_text().strip() == FIXTURE.strip()
    assert "generation ended before ['diffspec start', 'diffspec step']" in capsys.readouterr().err


def test_hit_rates_outside_0_to_100_percent_are_left_out_of_the_average():
    summary = collect_ncu.KernelSummary("auto step", "", "k")
    for rate, sectors in ((40.0, 1000.0), (184.2, 2500.0), (80.0, 3000.0)):
        summary.add(collect_ncu.KernelLaunch(0, "k", "auto step", "", {
            DURATION: 1.0, L2_HIT_RATE: rate, "lts__t_sectors.sum": sectors}))
    assert summary.l2_hit_rate == pytest.approx(70.0)  # the 184% launch's 2,500 lookups do not count
    assert summary.l2_out_of_range == 1 and summary.l2_sectors == 6500.0


def test_report_only_rewrites_the_tables_from_an_earlier_run(tmp_path):
    args = _args(tmp_path, "--report-only", "--steps", "auto step")
    args.out_dir.mkdir(parents=True)
    (args.out_dir / "ncu_raw.csv").write_text(FIXTURE)
    (args.out_dir / "ncu_driver.json").write_text(json.dumps(
        {"prompt_tokens": 256, "device": "H200", "profiled": ["auto step"]}))
    (args.out_dir / "ncu_kernels.json").write_text(json.dumps({"command": ["ncu", "--earlier"]}))
    assert collect_ncu.collect(args) == 0  # no ncu needed
    table = (args.out_dir / "ncu_kernels.md").read_text()
    assert "`ncu --earlier`" in table and "| `fused_layer_kernel` | - | 2 | 40.0 | 70.0 |" in table
    assert json.loads((args.out_dir / "ncu_kernels.json").read_text())["command"] == ["ncu", "--earlier"]
