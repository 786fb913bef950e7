"""The decode step compiled ahead of time: a shared library built once per model architecture,
which a later process loads in milliseconds, instead of compiling for tens of seconds.

Why: torch.compile (compiled_decode.py) traces and compiles in every process that wants the fast
step — seconds with a warm cache, a minute on a fresh machine — so a chat, or a server that has
just started, waits or runs eagerly meanwhile. AOTInductor compiles the same graph (torch.export
of the model's forward for one-token rows, LM head included) to C++ once; loading it is a
`dlopen`, without importing the compiler at all.

A package holds the code but not the weights: every matrix, norm and table stays the model's
own tensor, handed over at load (no second copy in memory or on disk). What the package keeps
is what the graph bakes in, so its name covers those: the model's class and config, the shape
and dtype of every weight, pellucid's model code, torch's version and the CPU's vector
extensions. Any checkpoint of the same architecture shares it.

Two packages: one for a few rows (1..DENSE_ROWS: a request alone, its guesses (drafter.py), a
few batch-mates) and one for many (up to 128: a batch of decoding requests, multiplied by the
dense copies of the packed layers that keep them: quant.py); the number of rows, the block-table
width and the pool's size are dynamic. One graph for one row and for a few, unlike
torch.compile's (compiled_decode.py), which specializes one row: the graph's code is the same
for every row count, so a row's logits do not change when guesses or a batch-mate join it, and
a greedy reply is the same either way. The dense copies exist only once a batch needs them
(models/quant.py), so the package for many rows is loaded at its first step.
Steps of more rows, pre-fill and traced steps stay eager (or go to torch.compile with
`compile=True`).

    pellucid compile [--model M]      # builds them (make setup does, for the default model)
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import zipfile
from pathlib import Path

import torch
from torch import Tensor, nn

from pellucid.atomic import atomic_path
from pellucid.cpu import isa_flags
from pellucid.engine.compiled_decode import KINDS as STEP_KINDS
from pellucid.engine.compiled_decode import Example, most_rows
from pellucid.models.context import DecodeBatch, ForwardContext
from pellucid.models.llama import LlamaModel
from pellucid.models.packed_model import make_dense, use_fbgemm_head
from pellucid.models.quant import DENSE_ROWS, PackedLinear
from pellucid.weights.cache import cache_root

log = logging.getLogger("pellucid")
LOAD_ERRORS = (RuntimeError, KeyError, OSError, zipfile.BadZipFile)  # a package that will not load
# the package's fewest rows -> its name; it serves the kinds of step (compiled_decode.kind) from
# there to the next package's
KINDS = {1: "few-rows", DENSE_ROWS + 1: "many-rows"}
# The compiler's options for every kernel of the step: see compiled_decode.OPTIONS.
OPTIONS = {
    "size_asserts": False,
    "alignment_asserts": False,
    "scalar_asserts": False,
    "realize_cpu_opcount_threshold": 8,
    "emulate_precision_casts": True,
    # the weights stay out of the library; the few tensors the compiler makes itself (the
    # int4 kernel's group size) are stored beside it, read at load
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}


class DecodeStep(nn.Module):
    """The step as export sees it: tensors in, logits out (the ForwardContext is rebuilt inside,
    since a package's inputs are a flat list of tensors)."""

    def __init__(self, model: LlamaModel):
        super().__init__()
        self.model = model

    def forward(
        self, ids: Tensor, positions: Tensor, slots: Tensor, decode: list[Tensor],
        k_cache: list[Tensor], v_cache: list[Tensor],
    ) -> Tensor:  # fmt: skip
        ctx = ForwardContext(k_cache, v_cache, slots, [], DecodeBatch(*decode))
        return self.model.compute_logits(self.model.hidden_states(ids, positions, ctx)[0])


def step_inputs(ids: Tensor, positions: Tensor, ctx: ForwardContext) -> list[Tensor]:
    """The step's inputs in the package's order: ids (1, B), positions (B,), slots (B,), the
    decode batch's eight tensors, then every layer's K, then every layer's V."""
    assert ctx.decode is not None and not ctx.prefills
    d = ctx.decode
    decode = [d.rows, d.block_tables, d.ctx_lens, d.blocks, d.block_rows, d.block_starts]
    decode += [d.row_blocks, d.row_blocks_valid]
    return [ids, positions, ctx.slot_mapping, *decode, *ctx.k_cache, *ctx.v_cache]


def package_paths(model: LlamaModel) -> dict[int, Path]:
    """Where the packages for this model's architecture live, by kind of step."""
    h = hashlib.sha256()
    h.update(f"{type(model).__qualname__}|{model.cfg!r}|{torch.__version__}|".encode())
    h.update("|".join(isa_flags()).encode())
    h.update(f"|decode_kernel={model.layers[0].self_attn.decode_kernel}|".encode())
    # which layers keep dense copies for many rows: with AMX, not where oneDNN is kept off it
    # (ONEDNN_MAX_CPU_ISA), and a package built with them cannot load without them
    keeps = [
        name for name, m in model.named_modules() if isinstance(m, PackedLinear) and m.keeps_dense()
    ]
    h.update(f"|keeps_dense={','.join(keeps)}|".encode())
    for name, t in sorted(named_tensors(model).items()):
        if not name.endswith(".dense"):  # made later or not (the code's hash covers them)
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}|".encode())
    for source in sorted((Path(__file__).parents[1] / "models").glob("*.py")):
        h.update(source.read_bytes())
    h.update(Path(__file__).read_bytes())
    folder, key = cache_root() / "aot", h.hexdigest()[:24]
    return {kind: folder / f"decode-{name}-{key}.pt2" for kind, name in KINDS.items()}


def named_tensors(model: LlamaModel) -> dict[str, Tensor]:
    """Every tensor the step may read, by the name export gives it: parameters, buffers, and
    plain tensor attributes (a tied head's table), each under "model." (DecodeStep's field)."""
    found: dict[str, Tensor] = {}
    for prefix, module in model.named_modules():
        for attr, value in [*module.named_parameters(recurse=False), *vars(module).items()]:
            if isinstance(value, Tensor):
                found[".".join(p for p in ("model", prefix, attr) if p)] = value
        for attr, value in module.named_buffers(recurse=False):
            found[".".join(p for p in ("model", prefix, attr) if p)] = value
    return found


def build(model: LlamaModel, example: Example, kind: int, path: Path) -> None:
    """Export and compile the package whose fewest rows are `kind`, on an `example` step
    (written to a scratch pool), into `path`. Takes a few minutes on 2 cores."""
    use_fbgemm_head(model)
    if kind > DENSE_ROWS:
        make_dense(model)  # the graph reads them, as the model's own tensors
    # export would specialize a size that is 1 in the example: the few-row one is traced on 2
    step = example(max(kind, 2))
    dims = _dims(step[2], kind)
    # strict: traced by dynamo, as torch.compile traces (the model branches on is_compiling);
    # without gradients, as the runner's steps run (the model branches on that too: RMSNorm)
    with torch.no_grad():
        ep = torch.export.export(DecodeStep(model), _args(*step), dynamic_shapes=dims, strict=True)
    with atomic_path(path) as tmp:
        full = tmp.with_name(tmp.name + ".full.pt2")
        try:
            torch._inductor.aoti_compile_and_package(
                ep, package_path=str(full), inductor_configs=OPTIONS
            )
            _without_weights(full, tmp, set(named_tensors(model)))
        finally:
            full.unlink(missing_ok=True)


class AotDecode:
    """A package for `kind` of step: call it as the eager step, (ids (1, B), positions, ctx) ->
    logits. Loaded at once, or at the first call where it reads the dense copies (the many-row
    step: see the module's docstring), which are made then."""

    def __init__(self, path: Path, model: LlamaModel, kind: int):
        self.path, self.model = path, model
        self.dense = kind > DENSE_ROWS
        self.loader: torch._C._aoti.AOTIModelPackageLoader | None = None
        self.failed = False
        if not self.dense:
            self.load()

    def load(self) -> None:
        use_fbgemm_head(self.model)  # as when it was built: the graph may call fbgemm for it
        if self.dense:
            make_dense(self.model)
        # torch's C++ loader directly: the Python wrapper imports the compiler, slower than the load
        loader = torch._C._aoti.AOTIModelPackageLoader(str(self.path), "model", True, 1, -1)
        own = named_tensors(self.model)
        constants = _stored_constants(self.path)
        for fqn in loader.get_constant_fqns():
            if fqn not in constants:
                constants[fqn] = own[fqn]
        # user_managed: the package points at the model's tensors, without copying them
        loader.load_constants(constants, False, True, True)
        self.loader = loader

    def __call__(self, ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        if self.loader is None and not self.failed:
            try:
                self.load()
            except LOAD_ERRORS as e:
                log.warning("could not load %s (%s); run `pellucid compile` again", self.path, e)
                self.failed = True
        if self.loader is None:  # eager, as without the package
            return self.model.compute_logits(self.model.hidden_states(ids, positions, ctx)[0])
        return self.loader.boxed_run(step_inputs(ids, positions, ctx))[0]


def start_head_packing(model: LlamaModel) -> None:
    """Where a package will be loaded, start packing its LM head for fbgemm now: the packing
    runs in a thread (models/fbgemm.py), so the caller's loading (the tokenizer) overlaps it."""
    if any(path.exists() for path in package_paths(model).values()):
        use_fbgemm_head(model)


def load(model: LlamaModel) -> dict[int, AotDecode]:
    """The packages built for this model's architecture, by the kinds of step they serve
    (compiled_decode.kind); {} when none is."""
    loaded = {}
    for kind, path in package_paths(model).items():
        if path.exists():
            try:
                package = AotDecode(path, model, kind)
            except LOAD_ERRORS as e:
                log.warning("could not load %s (%s); run `pellucid compile` again", path, e)
                continue
            fewest, most = rows_of(kind)
            loaded |= {k: package for k in STEP_KINDS if fewest <= k <= most}
    return loaded


def rows_of(kind: int) -> tuple[int, int]:
    """The fewest and the most rows of the package named by `kind`."""
    later = [k for k in KINDS if k > kind]
    most = later[0] - 1 if later else most_rows(kind)
    assert most is not None, "the last kind of step a package serves has a bound"
    return kind, most


def _args(ids: Tensor, positions: Tensor, ctx: ForwardContext) -> tuple:
    flat = step_inputs(ids, positions, ctx)
    n = len(ctx.k_cache)
    return flat[0], flat[1], flat[2], flat[3:11], flat[11 : 11 + n], flat[11 + n :]


def _dims(ctx: ForwardContext, kind: int) -> tuple:
    """Which sizes vary between calls: the rows, the block-table width, the blocks the rows use
    in all, and the pool's number of blocks."""
    from torch.export import Dim

    fewest, most = rows_of(kind)
    rows = Dim("rows", min=fewest, max=most)
    width, total = Dim("width", min=2, max=1 << 16), Dim("total", min=2, max=1 << 20)
    pool = Dim("pool", min=2, max=1 << 24)
    b, bw = {0: rows}, {0: rows, 1: width}
    decode = [b, bw, b, {0: total}, {0: total}, {0: total}, bw, bw]
    kv = [{0: pool}] * len(ctx.k_cache)
    return {1: rows}, b, b, decode, kv, kv


def _weights_config(z: zipfile.ZipFile) -> tuple[str, str]:
    """The archive's list of stored tensors, and the folder their files are in."""
    name = next(n for n in z.namelist() if n.endswith("/weights_config.json"))
    return name, name.split("/data/")[0] + "/data/weights/"


def _without_weights(src: Path, dst: Path, own: set[str]) -> None:
    """Copy the package without the tensors the model holds itself."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        config_name, folder = _weights_config(zin)
        config = json.loads(zin.read(config_name))
        dropped = {folder + entry[0] for fqn, entry in config.items() if fqn in own}
        kept = {fqn: entry for fqn, entry in config.items() if fqn not in own}
        for info in zin.infolist():
            if info.filename == config_name:
                zout.writestr(info, json.dumps(kept))
            elif info.filename not in dropped:
                zout.writestr(info, zin.read(info.filename))


def _stored_constants(path: Path) -> dict[str, Tensor]:
    """The tensors the compiler made and the package keeps (each a few bytes)."""
    with zipfile.ZipFile(path) as z:
        config_name, folder = _weights_config(z)
        stored = {}
        for fqn, (file, shape, stride, offset) in json.loads(z.read(config_name)).items():
            t = torch.load(io.BytesIO(z.read(folder + file)), weights_only=True)
            stored[fqn] = t.as_strided(shape, stride, offset)
        return stored
