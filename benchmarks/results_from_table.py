"""A bench results.json rebuilt from the markdown table a bench run printed, where the run's own results.json did not
come back from the device: the table's rows (median, min, max) with the command and device that made them, so that
`streamfusion tune --merge-from` and `--report` read them like any bench output.

    python benchmarks/results_from_table.py TABLE.md --device "NVIDIA H100 80GB HBM3" --world 4 \
        --command "streamfusion bench --level layer --workloads flux-dev:4096 --machines 2 ..." --out FOLDER
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from streamfusion_diffusers.bench.layer import padded_length
from streamfusion_diffusers.choice.workloads import parse_workload, workload_specs


def rows_of(text: str, tokens: dict[str, int]) -> list[dict]:
    """The layer rows of a bench table: workload, method, layout and the median, min and max ms of each."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 6 or cells[1] != "layer":
            continue
        low, high = (float(x) for x in cells[5].split(" - "))
        rows.append({"workload": cells[0], "level": "layer", "tokens": tokens[cells[0]], "method": cells[2],
                     "layout": cells[3], "ms": float(cells[4]), "min_ms": low, "max_ms": high})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", help="a file holding the bench run's markdown table (a log or a .md)")
    parser.add_argument("--command", required=True, help="the bench command line the table came from")
    parser.add_argument("--device", required=True, help="torch.cuda.get_device_name() of the run's GPUs")
    parser.add_argument("--world", type=int, required=True, help="processes of the run")
    parser.add_argument("--out", required=True, help="folder to write results.json into")
    args = parser.parse_args()
    specs = workload_specs(args.command.split("--workloads")[1].split()[0])
    tokens = {w.name: padded_length(w, args.world) for w in map(parse_workload, specs)}
    rows = rows_of(Path(args.table).read_text(), tokens)
    if not rows:
        raise SystemExit(f"{args.table}: no layer rows of a bench table in it")
    setup = {"command": args.command, "world": args.world, "gpu": True, "device": args.device,
             "source": f"rebuilt from {args.table}", "levels": ["layer"], "tokens": tokens}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out / 'results.json'} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
