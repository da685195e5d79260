"""Memory hazards inside one program of a compiled Triton kernel, read off its Triton IR without a GPU.

The fused decode kernels store into global memory and read it back within one program: the first kernel writes the
new token's key and value and then attends over the row, the second kernel's tail reads back the row it scored, the
blockwise form of wide rows counts and ranks a row it wrote, and the order buffer is compacted in place. The threads
of a program run in no set order. A thread that reads what *another* thread of its program stored must be ordered
after that store by a barrier (``tl.debug_barrier()``, ``gpu.barrier`` in the IR), and so must a store over what
other threads may still be reading. Triton's interpreter runs a program as one sequence and cannot show a missing
barrier; on a GPU it is a wrong value now and then. :func:`hazards` finds them in a kernel's TTIR
(``CompiledKernel.asm["ttir"]``, after Triton's inlining and common-subexpression elimination), statically:

* a **read after write**: a ``tt.load`` whose pointer derives from the same kernel argument as a store (or atomic)
  earlier in program order (loops included: a store late in one iteration comes before a load early in the next),
  with no barrier between them on some path;
* a **write after read**: a store or atomic through an argument that a load since the last barrier read, unless the
  store cannot run before every thread's load returned: its pointer, value or mask, or the condition of an enclosing
  ``if`` or the bounds of an enclosing loop, depend on a reduction *to a scalar* of that load's values (of the same
  iteration: what a loop carries from an earlier iteration settles nothing of the current one).

What it assumes, and so does not report:

* a load and a store through the same tensor of pointers (one SSA value): each element is then read and written by
  the thread that holds it, as Triton maps a tensor of one layout onto threads. A layout that replicates elements
  over threads could still race there; this check does not see layouts. Through a single pointer it does not hold:
  one thread stores the value and every thread loads it;
* atomics against atomics (they do not race by definition).

It knows nothing of addresses: two accesses through one argument at disjoint offsets (a matrix's last row against its
other rows, one block of a loop against the next) count as the same memory. The kernels put a barrier there rather
than a proof (one ``bar.sync``, nothing against a program's work). Hazards between programs (each writes its own row
and KV head) and between launches (ordered by the stream) are not its concern. An operation it cannot follow (a call
that was not inlined, unstructured control flow, a pointer made from an integer) raises :class:`ValueError` rather
than passing unchecked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: operations whose results carry no pointer, whatever their operands
_DATA_RESULTS = {"tt.load", "tt.atomic_rmw", "tt.atomic_cas", "tt.ptr_to_int", "tt.reduce", "tt.scan"}
_LOADS = {"tt.load"}
_WRITES = {"tt.store", "tt.atomic_rmw", "tt.atomic_cas"}
_ATOMICS = {"tt.atomic_rmw", "tt.atomic_cas"}
_BARRIERS = {"gpu.barrier"}
_REGIONS = {"scf.for", "scf.if", "tt.reduce", "tt.scan"}
#: what the analysis cannot follow: memory reached another way, or control flow other than structured ifs and loops
_UNSUPPORTED = ("tt.call", "tt.int_to_ptr", "scf.while", "cf.", "tt.descriptor", "tt.make_tensor_ptr", "tt.advance")
_SSA = re.compile(r"%[\w$.-]+")
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")


@dataclass
class Op:
    """One operation of the IR: its name, the SSA values it defines and uses (renamed apart by scope), its regions
    with their block arguments (each with its initial value if it is a loop-carried one), its source location, and
    ``scalar``: for a ``tt.reduce`` whether its result is one value, for a load or store whether it goes through one
    pointer (not a tensor of them)."""

    name: str
    results: list[str]
    operands: list[str]
    loc: str
    index: int
    regions: list[list[Op]] = field(default_factory=list)
    block_args: list[list[tuple[str, str | None]]] = field(default_factory=list)
    scalar: bool = False


@dataclass(frozen=True)
class Hazard:
    """Two accesses of one kernel argument by a program's threads that no barrier orders on some path: the kind
    (``"read after write"`` or ``"write after read"``), the argument, and each access's source lines, innermost
    first (``file:line``, then the lines that called it)."""

    kind: str
    argument: str
    first: tuple[str, ...]
    second: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.kind} on {self.argument}: {' < '.join(self.first)}, then {' < '.join(self.second)}"


def _base(name: str) -> str:
    """``%x#1`` (one result of several) is ``%x``: the results of one operation share what flows into them."""
    return name.split("#")[0]


def _split_loc(line: str) -> tuple[str, str]:
    m = re.search(r"\s+loc\((#loc\d*|unknown)\)\s*$", line)
    return (line, "") if not m else (line[: m.start()], m.group(1))


def _header(line: str) -> tuple[list[str], str, str]:
    """The results, the name and the rest of an operation's line."""
    results: list[str] = []
    m = re.match(r"^((?:%[\w$.-]+(?::\d+)?)(?:\s*,\s*%[\w$.-]+(?::\d+)?)*)\s*=\s*(.*)$", line)
    if m:
        results = [r.split(":")[0] for r in re.findall(r"%[\w$.-]+(?::\d+)?", m.group(1))]
        line = m.group(2)
    m = re.match(r'^"?([\w.]+)"?(.*)$', line)
    return (results, m.group(1), m.group(2)) if m else (results, line, "")


def parse(ttir: str) -> tuple[list[Op], dict[str, str], list[str]]:
    """The body of the module's one kernel as a tree of :class:`Op`, its location table, and its pointer arguments."""
    locs: dict[str, str] = {}
    lines: list[str] = []
    for raw in ttir.splitlines():
        m = _LOC_DEF.match(raw)
        if m:
            locs[m.group(1)] = m.group(2)
        else:
            lines.append(raw)
    func = next((line for line in lines if line.strip().startswith("tt.func")), None)
    if func is None:
        raise ValueError("no tt.func in this IR")
    arguments = re.findall(r"(%[\w$.-]+):\s*!tt\.ptr", func)
    root: list[Op] = []
    # names are scoped by region: sibling regions (an if's branches, two loops) reuse them for other values, so each
    # definition gets a name of its own (name@n) and a use takes the innermost one in sight
    stack: list[tuple[Op | None, list[Op], dict[str, str]]] = [(None, root, {})]
    counter = 0

    def define(name: str) -> str:
        stack[-1][2][name] = f"{name}@{counter}"
        return stack[-1][2][name]

    def use(name: str) -> str:
        name = _base(name)
        for _, _, scope in reversed(stack):
            if name in scope:
                return scope[name]
        return name  # an argument of the kernel

    for raw in lines[lines.index(func) + 1 :]:
        text, loc = _split_loc(raw.strip())
        if not text:
            continue
        if text.startswith("^bb"):  # a region's block arguments (a reduction's operands)
            owner = stack[-1][0]
            if owner is not None:
                owner.block_args[-1].extend((define(a), None) for a in re.findall(r"(%[\w$.-]+):", text))
            continue
        if text.startswith("}"):
            owner, _, _ = stack.pop()
            if owner is None:  # the kernel's end
                break
            if text.endswith("{"):  # "} else {": the same operation's next region
                owner.regions.append([])
                owner.block_args.append([])
                stack.append((owner, owner.regions[-1], {}))
            else:
                owner.loc = owner.loc or loc
                if owner.name == "tt.reduce":  # "}) : (tensor<1024xf32>) -> f32"
                    owner.scalar = "tensor<" not in text.split("->")[-1]
            continue
        results, name, rest = _header(text)
        if name.startswith(_UNSUPPORTED):
            raise ValueError(f"{name} is beyond this analysis ({where(loc, locs)})")
        opens = rest.rstrip().endswith("{")
        if opens and name not in _REGIONS:
            raise ValueError(f"{name}'s regions are beyond this analysis ({where(loc, locs)})")
        carried: list[tuple[str, str | None]] = []
        if name == "scf.for":  # "%i = %lo to %hi step %st iter_args(%a = %init, ...)"
            iv = re.match(r"^\s*(%[\w$.-]+)\s*=", rest)
            if iv:
                carried.append((iv.group(1), None))
            carried += [
                (a, use(b)) for a, b in re.findall(r"(%[\w$.-]+)\s*=\s*(%[\w$.#-]+)", rest[iv.end() if iv else 0 :])
            ]
        own = {a for a, _ in carried}
        operands = [use(x) for x in _SSA.findall(rest if opens else rest.split(" : ")[0]) if _base(x) not in own]
        counter += 1
        op = Op(name, [define(r) for r in results], operands, loc, counter)
        if name in _LOADS or name in _WRITES:  # through a pointer, not a tensor of them: "tt.load %p : !tt.ptr<f32>"
            op.scalar = rest.split(" : ", 1)[-1].lstrip("( ").startswith("!tt.ptr")
        stack[-1][1].append(op)
        if opens:
            op.regions.append([])
            stack.append((op, op.regions[-1], {}))
            op.block_args.append([(define(a), init) for a, init in carried])
    return root, locs, arguments


def where(loc: str, locs: dict[str, str], depth: int = 0) -> list[str]:
    """The source lines of a location, innermost first (``file:line``), through call sites and names."""
    if depth > 64 or not loc or loc == "unknown":
        return []
    text = locs.get(loc, loc)
    m = re.match(r'^"([^"]+)":(\d+):\d+$', text)
    if m:
        return [f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}"]
    m = re.match(r"^callsite\((#loc\d*) at (#loc\d*)\)$", text)
    if m:
        return where(m.group(1), locs, depth + 1) + where(m.group(2), locs, depth + 1)
    m = re.match(r'^"[^"]*"\((#loc\d*)\)$', text) or re.match(r"^fused\[(#loc\d*)", text)
    return where(m.group(1), locs, depth + 1) if m else []


def _walk(ops: list[Op]):
    for op in ops:
        yield op
        for region in op.regions:
            yield from _walk(region)


def _flow(body: list[Op], arguments: list[str]) -> tuple[dict[str, set[str]], dict[str, set[int]]]:
    """Per SSA value: the pointer arguments it derives from, and the loads *settled* in it (whose values reached it
    through a reduction to a scalar, so that it exists only once every thread's load returned). A fixed point over
    loop-carried values; what a loop's body yields to its next iteration settles none of the body's loads."""
    ptr: dict[str, set[str]] = {a: {a} for a in arguments}
    loads: dict[str, set[int]] = {}  # the loads whose values flow into a value
    settled: dict[str, set[int]] = {}
    none: frozenset = frozenset()
    # (value, its sources as (value, the loads it does not pass on), the operation defining it)
    edges: list[tuple[str, list[tuple[str, frozenset]], Op]] = []
    for op in _walk(body):
        for res in op.results:
            sources = [(o, none) for o in op.operands]
            if op.name in ("scf.for", "scf.if"):  # and what its regions yield
                sources += [(o, none) for region in op.regions for y in region if y.name == "scf.yield"
                            for o in y.operands]  # fmt: skip
            edges.append((res, sources, op))
        for args, region in zip(op.block_args, op.regions):
            inside = frozenset(inner.index for inner in _walk(region))
            yields = [y for y in region if y.name == "scf.yield"]
            for k, (arg, init) in enumerate(a for a in args if a[1] is not None):
                sources = [(init, none)] + [(y.operands[k], inside) for y in yields if len(y.operands) > k]
                edges.append((arg, sources, op))
    changed = True
    while changed:
        changed = False
        for res, sources, op in edges:
            p: set[str] = set()
            l: set[int] = set()
            s: set[int] = set()
            for src, drop in sources:
                p |= ptr.get(src, set())
                l |= loads.get(src, set()) - drop
                s |= settled.get(src, set()) - drop
            if op.name in _DATA_RESULTS and res in op.results:
                p = set()
            if op.name in _LOADS and res in op.results:
                l = l | {op.index}  # after the loads its pointer and mask were computed from
            if op.name == "tt.reduce" and op.scalar and res in op.results:
                s = s | l
            if not (p <= ptr.get(res, set()) and l <= loads.get(res, set()) and s <= settled.get(res, set())):
                ptr[res] = ptr.get(res, set()) | p
                loads[res] = loads.get(res, set()) | l
                settled[res] = settled.get(res, set()) | s
                changed = True
    return ptr, settled


def hazards(ttir: str) -> list[Hazard]:
    """Every read after write and write after read within a program of the kernel whose TTIR this is that no barrier
    orders (see the module), each once."""
    body, locs, arguments = parse(ttir)
    ptr, settled = _flow(body, arguments)
    by_index = {op.index: op for op in _walk(body)}
    found: dict[tuple, Hazard] = {}

    def access(op: Op) -> tuple[str, set[str]]:
        p = op.operands[0] if op.operands else ""
        if not ptr.get(p):
            raise ValueError(f"{op.name} through a pointer of no argument ({where(op.loc, locs)})")
        return p, ptr[p]

    def after(operands: list[str]) -> set[int]:
        out: set[int] = set()
        for o in operands:
            out |= settled.get(o, set())
        return out

    def report(kind: str, argument: str, first: int, second: Op) -> None:
        h = Hazard(kind, argument, tuple(where(by_index[first].loc, locs)), tuple(where(second.loc, locs)))
        found[(h.kind, h.argument, h.first, h.second)] = h

    def join(a: tuple, b: tuple) -> tuple:
        return tuple(
            {k: x.get(k, frozenset()) | y.get(k, frozenset()) for k in x.keys() | y.keys()} for x, y in zip(a, b)
        )

    def run(ops: list[Op], state: tuple, context: frozenset) -> tuple:
        """The state after ``ops`` (per argument: the writes and the loads since the last barrier, as (operation,
        pointer value)), reporting hazards on the way; ``context``: the loads settled before any of ``ops`` runs (by
        the condition of an enclosing ``if`` or the bounds of an enclosing loop)."""
        writes, reads = state
        for op in ops:
            if op.name in _BARRIERS:
                writes, reads = {}, {}
            elif op.name in _LOADS:
                p, args = access(op)
                for a in args:
                    for w, w_ptr in writes.get(a, ()):
                        if w_ptr != p or op.scalar or by_index[w].scalar:
                            report("read after write", a, w, op)
                reads = {**reads, **{a: reads.get(a, frozenset()) | {(op.index, p)} for a in args}}
            elif op.name in _WRITES:
                p, args = access(op)
                done = after(op.operands) | context
                for a in args:
                    for r, r_ptr in reads.get(a, ()):
                        if (r_ptr != p or op.scalar or by_index[r].scalar) and r not in done:
                            report("write after read", a, r, op)
                kind = {(op.index, p)}
                writes = {**writes, **{a: writes.get(a, frozenset()) | kind for a in args}}
            elif op.name == "scf.if":
                inner = context | after(op.operands)
                branches = [run(region, (writes, reads), inner) for region in op.regions]
                if len(branches) == 1:  # no else: the state as it was
                    branches.append((writes, reads))
                writes, reads = join(branches[0], branches[1])
            elif op.name == "scf.for":
                inner = context | after(op.operands[:3])  # the bounds and the step, not the carried values
                entry = current = (writes, reads)
                while True:  # the sets only grow: a fixed point, as after any number of iterations
                    merged = join(entry, run(op.regions[0], current, inner))
                    if merged == current:
                        break
                    current = merged
                writes, reads = current
        return writes, reads

    run(body, ({}, {}), frozenset())
    return list(found.values())
