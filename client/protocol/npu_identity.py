"""UNVERIFIED ON HARDWARE. An Ascend NPU's `device_uuid`: the ACL runtime has no UUID, so it is read
from torch_npu's device properties and npu-smi's answers.

The engine names its NPU this way (kvstore_client.device) and the daemon each of its own
(kvstore_service.backends.npu), and the daemon matches the two strings: so the reading is here, once,
for both sides. Each side asks torch_npu and runs npu-smi itself; this module only reads what they say.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from kvstore_client.protocol.handle import UUID_RE, normalize_uuid


def npu_identity(props: Any, logical: int, env: Mapping[str, str], npu_smi: Callable[..., str]) -> str:
    """The identity of the process's NPU `logical`: torch_npu's `props.uuid` if it carries one, else
    npu-smi's VDie / PCIe id (as LMCache does) of the *physical* device behind it (mapped through
    ASCEND_RT_VISIBLE_DEVICES in `env` and `npu-smi info -m`), else "" (unknown).

    `props` is `torch.npu.get_device_properties(logical)`; `npu_smi(*args)` is the output of
    `npu-smi info <args>`, "" where it fails."""
    uuid = getattr(props, "uuid", None)
    if isinstance(uuid, str) and (uuid := normalize_uuid(uuid)) and UUID_RE.fullmatch(uuid):
        return uuid
    try:
        physical = physical_npu(logical, env)
    except ValueError:
        return ""  # an identity of the wrong device is worse than none
    a3 = "910_93" in str(getattr(props, "name", ""))  # Atlas A3 (Ascend910_93xx): two chips per card
    card, chip = npu_smi_card_chip(physical, parse_npu_smi_map(npu_smi("-m")), a3)
    return parse_npu_smi_board(npu_smi("-t", "board", "-i", str(card), "-c", str(chip)))


def physical_npu(logical: int, env: Mapping[str, str]) -> int:
    """The physical device id (npu-smi's "Chip Logic ID") of the process's logical NPU `logical`.

    The ACL runtime numbers only the devices ASCEND_RT_VISIBLE_DEVICES lets it see, in that list's
    order; npu-smi ignores the variable. Unset or empty: logical == physical."""
    if logical < 0:
        raise ValueError(f"NPU index {logical} is negative")
    raw = env.get("ASCEND_RT_VISIBLE_DEVICES", "").strip()
    if not raw:
        return logical
    try:
        ids = [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"ASCEND_RT_VISIBLE_DEVICES={raw!r} is not a comma-separated list of device ids") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"ASCEND_RT_VISIBLE_DEVICES={raw!r} names a negative device id")
    if logical >= len(ids):
        raise ValueError(f"NPU {logical} is not visible: ASCEND_RT_VISIBLE_DEVICES={raw!r} lists {len(ids)}")
    return ids[logical]


def parse_npu_smi_map(output: str) -> dict[int, tuple[int, int]]:
    """`npu-smi info -m` as {Chip Logic ID: (NPU ID, Chip ID)}; rows without a logic id (the Mcu) are skipped.

    The table's rows are "<NPU ID> <Chip ID> <Chip Logic ID> <Chip Name>"; the logic id is the
    physical device id the runtime uses when ASCEND_RT_VISIBLE_DEVICES is unset."""
    table: dict[int, tuple[int, int]] = {}
    for line in output.splitlines():
        fields = line.replace("|", " ").split()
        if len(fields) < 3 or not (fields[0].isdigit() and fields[1].isdigit() and fields[2].isdigit()):
            continue
        table.setdefault(int(fields[2]), (int(fields[0]), int(fields[1])))
    return table


def npu_smi_card_chip(physical: int, smi_map: Mapping[int, tuple[int, int]], a3: bool = False) -> tuple[int, int]:
    """The `-i <card> -c <chip>` npu-smi takes for physical device `physical`.

    From `npu-smi info -m` when it lists the device; otherwise by rule: on A3 (two chips per card)
    the device id is card * 2 + chip, elsewhere card = device id and chip 0."""
    if physical in smi_map:
        return smi_map[physical]
    if a3:
        return physical // 2, physical % 2
    return physical, 0


def parse_npu_smi_board(output: str) -> str:
    """A device identity from `npu-smi info -t board -i N -c 0`: the VDie ID, else the PCIe bus id, else ""."""
    vdie = re.search(r"VDie ID\s*:\s*([0-9A-Fa-f ]+)", output)
    if vdie:
        raw = vdie.group(1).replace(" ", "").strip()
        if raw and set(raw) != {"0"}:
            return f"vdie-{raw.lower()}"
    pci = re.search(r"PCIe Bus Info\s*:\s*([0-9A-Fa-f:.]+)", output)
    if pci:
        return f"pci-{pci.group(1).lower()}"
    return ""
