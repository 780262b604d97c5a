"""Prints the occupancy lines of an ncu --csv --page details report (.ci/gpu-checks.sh): per lerp
kernel, its dtype pair and layout, theoretical and achieved occupancy, registers, DRAM throughput
and duration. Usage: python .ci/ncu_summary.py ncu.csv"""

import csv
import re
import sys

WANTED = {
    "Theoretical Occupancy": "theor%",
    "Achieved Occupancy": "achvd%",
    "Registers Per Thread": "regs",
    "DRAM Throughput": "dram%",
    "Memory Throughput": "mem%",
    "Duration": "duration",
}


def short_name(kernel: str) -> str:
    """multi_tensor_kernel<fused_ema::cuda::LerpOp<float, __nv_bfloat16>, 1024> -> LerpOp<...>"""
    kernel = re.sub(r"fused_ema::cuda::", "", kernel)
    m = re.search(r"multi_tensor_kernel<(.+?)>\(", kernel)
    return m.group(1) if m else kernel[:80]


def main(path: str) -> int:
    text = open(path, encoding="utf-8", errors="replace").read()
    start = text.find('"ID"')
    if start < 0:
        print(f"{path}: no ncu table (did ncu profile any kernel?)")
        return 1
    rows = {}
    for row in csv.DictReader(text[start:].splitlines()):
        label = WANTED.get(row.get("Metric Name", ""))
        if label:
            key = (row["ID"], short_name(row["Kernel Name"]))
            rows.setdefault(key, {})[label] = f"{row['Metric Value']} {row['Metric Unit']}".strip()
    header = ["kernel", *WANTED.values()]
    print(" | ".join(header))
    for (_, name), metrics in rows.items():
        print(" | ".join([name] + [metrics.get(h, "-") for h in header[1:]]))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
