"""Memory hazards inside one program of a compiled Triton kernel, read off its Triton GPU IR without a GPU.

The fused decode kernels store into global memory and read it back within one program: the first kernel writes the
new token's key and value and then attends over the row, the second kernel's tail reads back the row it scored, the
blockwise form of wide rows counts and ranks a row it wrote, and the order buffer is compacted in place. The threads
of a program run in no set order. A thread that reads what *another* thread of its program stored must be ordered
after that store by a barrier (``tl.debug_barrier()``, ``gpu.barrier`` in the IR), and so must a store over what
other threads may still be reading. Triton's interpreter runs a program as one sequence and cannot show a missing
barrier; on a GPU it is a wrong value now and then. :func:`hazards` finds them statically in a kernel's TTGIR
(``CompiledKernel.asm["ttgir"]``: after inlining and common-subexpression elimination, with the layouts that map
each tensor's elements onto threads, and with loads where the software pipeliner moved them); it reads TTIR too,
without layouts:

* a **read after write**: a load (``tt.load``, the pipeliner's ``ttg.async_copy_global_to_local``, or on AMD GPUs
  ``amdg.buffer_load %base[%offsets]``, which reaches what its base and offsets do) whose pointer
  derives from the same kernel argument as a store or atomic earlier in program order (loops included: a store late
  in one iteration comes before a load early in the next), with no barrier between them on some path;
* a **write after read**: a store or atomic through an argument that a load since the last barrier read, unless the
  store cannot run before every thread's load returned: its pointer, value or mask, or the condition of an enclosing
  ``if`` or the bounds of an enclosing loop, depend on a reduction *to a scalar* of that load's values (of the same
  iteration: what a loop carries from an earlier iteration settles nothing of the current one).

What orders accesses besides ``gpu.barrier``: a layout conversion (``ttg.convert_layout``) that moves an element to a
warp that did not hold it, which Triton does through shared memory with a barrier of the whole program between its
writes and its reads (read off the two layouts: blocked, linear and slices of them; any other is not counted as a
barrier). What it assumes, and so does not report:

* a load and a store through the same tensor of pointers (one SSA value) whose layout holds each element in one
  thread: that thread reads and writes it. Through one pointer (every thread holds it, one stores it) or a layout
  that replicates elements over threads this does not hold, and such pairs are checked as any other;
* within a loop, the same tensor of pointers reaches other elements in each iteration, or the same ones from the
  same threads (the kernels' loops step by whole blocks);
* atomics against atomics (they do not race by definition).

It knows nothing of offsets: two accesses through one argument at disjoint offsets (a matrix's last row against its
other rows, one block of a loop against the next) count as the same memory. The kernels put a barrier there rather
than a proof (one ``bar.sync``, nothing against a program's work). Hazards between programs (each writes its own row
and KV head) and between launches (ordered by the stream) are not its concern. An operation it cannot follow (a call
that was not inlined, unstructured control flow, a pointer made from an integer, an operation on memory it does not
know) raises :class:`ValueError` rather than passing unchecked.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

#: operations whose results carry no pointer, whatever their operands
_DATA_RESULTS = {
    "tt.load", "tt.atomic_rmw", "tt.atomic_cas", "tt.ptr_to_int", "tt.reduce", "tt.scan",
    "ttg.async_copy_global_to_local", "amdg.buffer_load", "amdg.buffer_atomic_rmw", "amdg.buffer_atomic_cas",
}  # fmt: skip
#: a load of global memory; in TTGIR the software pipeliner's asynchronous copies into shared memory too, issued where
#: the pipeliner put them (an iteration ahead), which is the order this check follows, and on AMD GPUs the buffer
#: loads Triton turns loads into (``amdg.buffer_load %base[%offsets]``)
_LOADS = {"tt.load", "ttg.async_copy_global_to_local", "amdg.buffer_load"}
_WRITES = {"tt.store", "tt.atomic_rmw", "tt.atomic_cas", "amdg.buffer_store", "amdg.buffer_atomic_rmw",
           "amdg.buffer_atomic_cas"}  # fmt: skip
#: operations of shared memory and of the pipeliner's bookkeeping, which touch no global memory
_LOCAL = ("ttg.local_", "ttg.async_commit_group", "ttg.async_wait", "ttg.memdesc")
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
    ``scalar``: for a ``tt.reduce`` whether its result is one value; ``shared``: for a load or store whether an
    element it accesses is held by more than one thread (through one pointer, or a layout that replicates);
    ``barrier``: whether it orders the program's threads as a barrier does (``gpu.barrier``; in TTGIR a layout
    conversion that moves elements between warps)."""

    name: str
    results: list[str]
    operands: list[str]
    loc: str
    index: int
    regions: list[list[Op]] = field(default_factory=list)
    block_args: list[list[tuple[str, str | None]]] = field(default_factory=list)
    scalar: bool = False
    shared: bool = False
    barrier: bool = False
    address: str = ""


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
    layouts = dict(re.findall(r"^(#\w+) = (#.*)$", ttir, re.M))  # TTGIR's encodings ("#blocked3 = #ttg.blocked<...>")
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
        if re.search(r"load|store|atomic|copy", name) and not (
            name in _LOADS or name in _WRITES or name.startswith(_LOCAL)
        ):
            raise ValueError(f"{name}: memory this analysis does not follow ({where(loc, locs)})")
        if name in _LOADS or name in _WRITES:  # "tt.load %p, %m : tensor<1024x!tt.ptr<f32>, #blocked3>"
            op.shared = replicated(_first_type(rest.split(" : ", 1)[-1]), layouts)
            # what it accesses: its pointer, or a buffer operation's base and offsets ("%base[%offsets]")
            buffer = re.search(r"(%[\w$.#-]+)\[(%[\w$.#-]+)\]", rest)
            op.address = f"{use(buffer.group(1))}[{use(buffer.group(2))}]" if buffer else operands[0]
            if buffer:  # the base first: what the access's argument is read from
                operands.insert(0, use(buffer.group(1)))
        op.barrier = name in _BARRIERS
        if name == "ttg.convert_layout":  # "%y = ttg.convert_layout %x : tensor<1024xf32, #a> -> tensor<..., #b>"
            source, _, target = rest.split(" : ", 1)[-1].partition(" -> ")
            (shape, before), (_, after) = _tensor_type(source), _tensor_type(target)
            op.barrier = crosses_warps(before, after, shape, layouts)
        stack[-1][1].append(op)
        if opens:
            op.regions.append([])
            stack.append((op, op.regions[-1], {}))
            op.block_args.append([(define(a), init) for a, init in carried])
    return root, locs, arguments


def _first_type(text: str) -> str:
    """The first type of an operation's type list (``(tensor<4x!tt.ptr<f32>, #blocked>, ...) -> ...``)."""
    text = text.lstrip("( ")
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "<{[("
        depth -= ch in ">}])"
        if depth < 0 or (depth == 0 and ch in ",)"):
            return text[:i]
        if depth == 0 and ch == ">":
            return text[: i + 1]
    return text


def _tensor_type(text: str) -> tuple[list[int], str]:
    """``tensor<16x128xf32, #blocked>``: its shape and its encoding."""
    text = _first_type(text.strip())
    m = re.match(r"^tensor<(\d+(?:x\d+)*)x([a-z]\w*|!tt\.ptr<[^>]*>),\s*(.*)>$", text)
    if not m:
        raise ValueError(f"a tensor type this module does not read: {text}")
    return [int(x) for x in m.group(1).split("x") if x], m.group(3).strip()


def _ints(text: str, name: str) -> list[int]:
    m = re.search(rf"{name} = \[([\d, ]*)\]", text)
    return [int(x) for x in m.group(1).split(",") if x.strip()] if m else []


def _bases(text: str, name: str) -> list[list[int]]:
    m = re.search(rf"{name} = \[((?:\[[\d, ]*\],? ?)*)\]", text)
    return [[int(x) for x in b.split(",") if x.strip()] for b in re.findall(r"\[([\d, ]*)\]", m.group(1))] if m else []


def replicated(ptr_type: str, layouts: dict[str, str]) -> bool:
    """Whether an access through pointers of this type (or of this data type: an AMD buffer operation's) reaches an
    element from more than one thread: one pointer
    (every thread holds it), or a tensor whose layout replicates elements over threads or warps (a blocked layout
    whose threads and warps span more than the shape; a linear layout with a lane or warp basis of zeros; a slice of
    a dimension that threads or warps span). Unknown layouts count as replicating. TTIR has no layouts: its tensors
    count as not replicating."""
    if ptr_type.startswith("!tt.ptr"):
        return True
    m = re.match(r"^tensor<(\d+(?:x\d+)*)x(?:!tt\.ptr<[^>]*>|[a-z]\w*)(?:,\s*(.*))?>$", ptr_type)
    if not m:
        return True
    shape = [int(x) for x in m.group(1).split("x")]
    return m.group(2) is not None and _replicates(m.group(2).strip(), shape, layouts)


def _replicates(encoding: str, shape: list[int], layouts: dict[str, str], sliced: int | None = None) -> bool:
    encoding = layouts.get(encoding, encoding)
    if encoding.startswith("#ttg.slice<"):
        m = re.match(r"^#ttg\.slice<\{dim = (\d+), parent = (.*)\}>$", encoding)
        if not m or sliced is not None:
            return True
        dim = int(m.group(1))
        return _replicates(m.group(2).strip(), shape[:dim] + [1] + shape[dim:], layouts, dim)
    if encoding.startswith("#ttg.blocked<"):
        spt, tpw, wpc = (_ints(encoding, n) for n in ("sizePerThread", "threadsPerWarp", "warpsPerCTA"))
        if not (len(spt) == len(tpw) == len(wpc) == len(shape)):
            return True
        if sliced is not None and tpw[sliced] * wpc[sliced] > 1:
            return True
        return any(spt[d] * tpw[d] * wpc[d] > shape[d] for d in range(len(shape)) if d != sliced)
    if encoding.startswith("#ttg.linear<"):
        keep = [d for d in range(len(shape)) if d != sliced]
        bases = _bases(encoding, "lane") + _bases(encoding, "warp")
        return any(all(b[d] == 0 for d in keep) for b in bases)
    return True


def warps_holding(encoding: str, shape: list[int], layouts: dict[str, str]) -> dict[tuple, frozenset] | None:
    """Each element of a tensor of this shape and layout, and the warps holding it; None for a layout this module
    does not read (an MMA layout)."""
    encoding = layouts.get(encoding, encoding)
    m = re.match(r"^#ttg\.slice<\{dim = (\d+), parent = (.*)\}>$", encoding)
    if m:  # the parent's elements along the sliced dimension, all of them one element here
        dim, parent = int(m.group(1)), layouts.get(m.group(2).strip(), m.group(2).strip())
        if parent.startswith("#ttg.blocked<"):
            span = _ints(parent, "sizePerThread")[dim] * _ints(parent, "threadsPerWarp")[dim]
            span *= _ints(parent, "warpsPerCTA")[dim]
        elif parent.startswith("#ttg.linear<"):
            span = 1 << max((max(b[dim] for b in _bases(parent, n) if b) for n in ("register", "lane", "warp")
                             if _bases(parent, n)), default=0).bit_length()  # fmt: skip
        else:
            return None
        full = warps_holding(parent, shape[:dim] + [span] + shape[dim:], layouts)
        if full is None:
            return None
        out: dict[tuple, frozenset] = {}
        for coord, held in full.items():
            key = coord[:dim] + coord[dim + 1 :]
            out[key] = out.get(key, frozenset()) | held
        return out
    if encoding.startswith("#ttg.blocked<"):
        spt, tpw, wpc = (_ints(encoding, n) for n in ("sizePerThread", "threadsPerWarp", "warpsPerCTA"))
        order = _ints(encoding, "order")
        per_dim = []  # per dimension: each index's warp coordinates along it
        for d, size in enumerate(shape):
            cover = spt[d] * tpw[d] * wpc[d]
            held = [set() for _ in range(size)]
            for i in range(max(cover, size)):
                held[i % size].add((i % cover) // (spt[d] * tpw[d]) % wpc[d])
            per_dim.append(held)
        stride, strides = 1, [0] * len(shape)
        for d in order:
            strides[d], stride = stride, stride * wpc[d]
        out = {}
        for coord in itertools.product(*(range(s) for s in shape)):
            ids = [0]
            for d, x in enumerate(coord):
                ids = [w + c * strides[d] for w in ids for c in per_dim[d][x]]
            out[coord] = frozenset(ids)
        return out
    if encoding.startswith("#ttg.linear<"):
        reg, lane, warp = (_bases(encoding, n) for n in ("register", "lane", "warp"))
        out = {}
        for w in range(1 << len(warp)):
            for rest in range(1 << (len(reg) + len(lane))):
                coord = [0] * len(shape)
                for bit, base in enumerate(reg + lane + warp):
                    taken = (rest >> bit) & 1 if bit < len(reg) + len(lane) else (w >> (bit - len(reg) - len(lane))) & 1
                    if taken:
                        coord = [c ^ b for c, b in zip(coord, base)]
                key = tuple(c % s for c, s in zip(coord, shape))
                out[key] = out.get(key, frozenset()) | {w}
        return out
    return None


def crosses_warps(source: str, target: str, shape: list[int], layouts: dict[str, str]) -> bool:
    """Whether converting a tensor from one layout to another moves an element to a warp that did not hold it: Triton
    does that through shared memory, with a barrier of the whole program between its writes and its reads (which
    orders every access before it, as ``gpu.barrier`` does). False where a layout is not read here."""
    key = (source, target, tuple(shape))
    if key not in _CROSSING:
        before, after = warps_holding(source, shape, layouts), warps_holding(target, shape, layouts)
        _CROSSING[key] = (
            before is not None
            and after is not None
            and any(not held <= before.get(coord, frozenset()) for coord, held in after.items())
        )
    return _CROSSING[key]


_CROSSING: dict[tuple, bool] = {}


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
        """What the access reaches (one pointer value, or a buffer's base and offsets), and its arguments."""
        base = op.operands[0] if op.operands else ""
        if not ptr.get(base):
            raise ValueError(f"{op.name} through a pointer of no argument ({where(op.loc, locs)})")
        return op.address, ptr[base]

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
            if op.barrier:
                writes, reads = {}, {}
            elif op.name in _LOADS:
                p, args = access(op)
                for a in args:
                    for w, w_ptr in writes.get(a, ()):
                        if w_ptr != p or op.shared or by_index[w].shared:
                            report("read after write", a, w, op)
                reads = {**reads, **{a: reads.get(a, frozenset()) | {(op.index, p)} for a in args}}
            elif op.name in _WRITES:
                p, args = access(op)
                done = after(op.operands) | context
                for a in args:
                    for r, r_ptr in reads.get(a, ()):
                        if (r_ptr != p or op.shared or by_index[r].shared) and r not in done:
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
