"""Summarise an `ncu --page raw --csv` run of bench/prenorm_ncu.py (bench/device_run123.sh): for each profiled
launch its duration and the warp stall reasons that cost more than 0.2 cycles per issued instruction, largest
first. Usage: python3 bench/ncu_stalls.py FILE.csv"""
import csv
import sys


def rows(path: str):
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # the CSV, not ncu's ==PROF== lines
    table = list(csv.reader(lines))
    head, body = table[0], [r for r in table[2:] if len(r) == len(table[0])]  # row 1: units
    return head, body


def main(path: str) -> None:
    head, body = rows(path)
    col = {name: i for i, name in enumerate(head)}
    stall = [n for n in head if n.startswith("smsp__average_warps_issue_stalled_")]
    dur = next((n for n in head if n.startswith("gpu__time_duration")), None)
    for r in body:
        grid = r[col["Grid Size"]] if "Grid Size" in col else ""
        smem = col.get("launch__shared_mem_per_block_dynamic")
        smem = r[smem] if smem is not None else ""
        t = r[col[dur]] if dur else "?"
        parts = []
        for n in stall:
            try:
                v = float(r[col[n]].replace(",", ""))
            except ValueError:
                continue
            if v > 0.2:
                parts.append((v, n.removeprefix("smsp__average_warps_issue_stalled_").split("_per_issue")[0]))
        parts.sort(reverse=True)
        print(f"{r[col['Kernel Name']][:20]} grid {grid} smem {smem} duration {t}: "
              + ", ".join(f"{name} {v:.2f}" for v, name in parts))


if __name__ == "__main__":
    main(sys.argv[1])
