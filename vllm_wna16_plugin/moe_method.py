"""The FusedMoE method of `moe_wna16_plus`: create_weights, loading, backend choice, apply.

Parameters are registered under the checkpoint format's own names (so vLLM's
expert mapping finds them) but already in the plugin's kernel layout: each
checkpoint tensor is converted as it is loaded (weight_loading.py). After
loading, every expected tensor is checked present, act order is dropped when
g_idx is trivial, and the layer's runner (launch_plan.LayerRunner) prepares the
state of each backend its launch plans name, once (the `triton` backend sorts act
order's K into contiguous groups, padded on a tensor-parallel rank; the layer's
parameters then hold the sorted tensors). apply runs each batch on the plan of its size.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_wna16_plugin import _vllm, compose
from vllm_wna16_plugin.activation import check_expert_math
from vllm_wna16_plugin.backends import KernelTensors, MoEProblem
from vllm_wna16_plugin.backends.base import act_order_issue, act_order_padded, act_order_split_issue
from vllm_wna16_plugin.checkpoint_config import effective_group_size
from vllm_wna16_plugin.launch_plan import LayerRunner
from vllm_wna16_plugin.oracle import resolve_request, select_backend
from vllm_wna16_plugin.packing import check_packable
from vllm_wna16_plugin.scheme import PackFormat, WNA16Scheme
from vllm_wna16_plugin.weight_loading import (
    CHECKPOINT_NAMES,
    MoEShapes,
    TensorName,
    check_symmetric_zeros,
    convert_checkpoint_tensor,
)

logger = _vllm.init_logger(__name__)
_LOGGED: set[str] = set()


def kernel_param_shapes(scheme: WNA16Scheme, shapes: MoEShapes, num_experts: int) -> dict[str, tuple]:
    """(gemm, kind) -> (shape, dtype) of the kernel-layout parameters of one layer on this rank."""
    e, h, i = num_experts, shapes.hidden, shapes.intermediate_local
    b = scheme.bits
    g13 = h // shapes.group_size_w13
    g2 = (
        shapes.intermediate // scheme.group_size
        if scheme.desc_act and not scheme.is_channelwise
        else i // shapes.group_size_w2
    )
    out = {
        ("w13", "qweight"): ((e, 2 * i, h * b // 8), torch.uint8),
        ("w2", "qweight"): ((e, h, i * b // 8), torch.uint8),
        ("w13", "scales"): ((e, 2 * i, g13), None),
        ("w2", "scales"): ((e, h, g2), None),
    }
    if scheme.has_zero_point:
        out[("w13", "qzeros")] = ((e, 2 * i * b // 8, g13), torch.uint8)
        out[("w2", "qzeros")] = ((e, h * b // 8, g2), torch.uint8)
    else:
        # Symmetric GPTQ/AWQ files still carry qzeros, and some compressed-tensors writers a zero point: a
        # placeholder the loader checks holds the implied zero (check_symmetric_zeros) and skips.
        out[("w13", "qzeros")] = ((e, 0), torch.int32)
        out[("w2", "qzeros")] = ((e, 0), torch.int32)
    if scheme.desc_act or scheme.pack_format is PackFormat.GPTQ:
        out[("w13", "g_idx")] = ((e, 2, h), torch.int32)  # gate and up each have their own act order
        out[("w2", "g_idx")] = ((e, i), torch.int32)
    elif scheme.pack_format is PackFormat.CT_PACKED:
        # a weight_g_idx the config does not announce: a placeholder the loader checks is trivial (check_g_idx)
        out[("w13", "g_idx")] = ((e, 0), torch.int32)
        out[("w2", "g_idx")] = ((e, 0), torch.int32)
    if scheme.pack_format is PackFormat.CT_PACKED:
        out[("w13", "shape")] = ((e, 2), torch.int64)
        out[("w2", "shape")] = ((e, 2), torch.int64)
    return out


def _sorted_state(runner: LayerRunner) -> KernelTensors | None:
    """The act-order layout a layer's runner reads (backends.base.sort_act_order), shared by its backends or made
    by the one backend's prepare; None without act order."""
    if runner.tensors.a_perm is not None:
        return runner.tensors
    return next((s for s in runner.states.values() if getattr(s, "a_perm", None) is not None), None)


def make_moe_method(scheme: WNA16Scheme, moe_config, prefix: str):
    base = _vllm.fused_moe_method_base()

    class MoeWNA16PlusMethod(base):
        """Owns one routed-experts layer of a WNA16 checkpoint."""

        def __init__(self) -> None:
            super().__init__(moe_config)
            self.scheme = scheme
            self.prefix = prefix
            self.selection = None
            self.problem: MoEProblem | None = None
            self.runner: LayerRunner | None = None

        # ---------------------------------------------------------------- weights

        def create_weights(
            self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra
        ):
            check_expert_math(_vllm.layer_activation(layer), _vllm.layer_expert_math(layer), prefix)
            tp_rank, tp_size = _vllm.layer_tp(layer)
            intermediate = intermediate_size_per_partition * tp_size
            check_packable(scheme.bits, hidden_size, intermediate, prefix)
            shapes = MoEShapes(
                hidden=hidden_size,
                intermediate=intermediate,
                tp_rank=tp_rank,
                tp_size=tp_size,
                group_size_w13=effective_group_size(scheme, hidden_size, layer=f"{prefix} (gate/up, K=hidden)"),
                group_size_w2=effective_group_size(
                    scheme,
                    intermediate_size_per_partition,
                    layer=f"{prefix} (down, K=intermediate)",
                    tp_size=tp_size,
                    full_size_k=intermediate,
                ),
            )
            self.shapes = shapes
            self.params_dtype = params_dtype
            self.num_local_experts = num_experts
            self.loaded: set[tuple[str, int, str]] = set()
            self.processed = False  # process_weights_after_loading ran and nothing was loaded since
            names = CHECKPOINT_NAMES[scheme.pack_format]
            self.param_names: dict[tuple[str, str], str] = {}
            for (gemm, kind), (shape, dtype) in kernel_param_shapes(scheme, shapes, num_experts).items():
                name = f"{gemm}_{names[kind]}"
                fill = torch.zeros if kind != "qweight" else torch.empty
                param = torch.nn.Parameter(fill(shape, dtype=dtype or params_dtype), requires_grad=False)
                layer.register_parameter(name, param)
                _vllm.set_weight_attrs(param, {"weight_loader": self._make_loader(layer, kind, name, shape)})
                self.param_names[(gemm, kind)] = name
            # Fail before gigabytes are read: an explicit backend that cannot work errors now.
            self.problem = self._make_problem(
                layer, has_g_idx=scheme.desc_act, act_order_issue=act_order_split_issue(scheme, tp_size),
                act_order_padded=scheme.desc_act and not scheme.is_channelwise and tp_size > 1,
            )  # fmt: skip
            self._select(layer)

        def _ckpt_name(self, layer, expert_id: int, shard_id: str, kind: str) -> TensorName:
            """The checkpoint's name of one tensor, for messages (global expert id)."""
            proj = {"w1": layer.ckpt_gate_proj_name, "w3": layer.ckpt_up_proj_name, "w2": layer.ckpt_down_proj_name}
            suffix = CHECKPOINT_NAMES[self.scheme.pack_format][kind]
            return TensorName(layer.layer_name, expert_id, proj.get(shard_id, shard_id), suffix)

        def _make_loader(self, layer, kind: str, param_name: str, created: tuple):
            scheme, method = self.scheme, self

            def weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
                if tuple(param.shape) != created:
                    raise ValueError(
                        f"{layer.layer_name}.{param_name} holds the processed act-order layout {tuple(param.shape)} "
                        f"(sorted, padded on this tensor-parallel rank), not the checkpoint layout {created} the "
                        "loader writes: reload weights through vLLM's reload_weights, which restores the "
                        "checkpoint's shapes before loading"
                    )
                local = _vllm.layer_local_expert_id(layer, int(expert_id))
                if local < 0:
                    return False if return_success else None
                name = method._ckpt_name(layer, int(expert_id), shard_id, kind)
                if kind == "qzeros" and not scheme.has_zero_point:
                    check_symmetric_zeros(scheme, loaded_weight, name)  # the implied midpoint, never real zeros
                    return True if return_success else None
                if kind == "g_idx" and param.numel() == 0:  # compressed-tensors without actorder: must be trivial
                    convert_checkpoint_tensor(
                        scheme, method.shapes, kind, shard_id, loaded_weight, name, method.params_dtype
                    )
                    return True if return_success else None
                piece, rows = convert_checkpoint_tensor(
                    scheme, method.shapes, kind, shard_id, loaded_weight, name, method.params_dtype
                )
                if kind == "shape":
                    param.data[local] = piece.to(param.device)
                else:
                    dst = param.data[local][rows]
                    if tuple(dst.shape) != tuple(piece.shape):
                        raise ValueError(
                            f"{name}: converted shard has shape {tuple(piece.shape)}, "
                            f"the layer expects {tuple(dst.shape)}"
                        )
                    dst.copy_(piece.to(dst.device))
                method.loaded.add((param_name, local, shard_id))
                method.processed = False  # the parameters hold checkpoint-layout data again: process it
                return True if return_success else None

            return weight_loader

        def _missing(self, layer) -> list[str]:
            required = ["qweight", "scales"] + (["qzeros"] if self.scheme.has_zero_point else [])
            if self.scheme.desc_act:
                required.append("g_idx")
            missing = [
                (e, shard, kind)
                for e in range(self.num_local_experts)
                for shard in ("w1", "w3", "w2")
                for kind in required
                if (self.param_names[("w2" if shard == "w2" else "w13", kind)], e, shard) not in self.loaded
            ]
            if not missing:
                return []
            # checkpoint names carry global expert ids (they differ from local ones under EP)
            to_global: dict[int, int] = {}
            for g in range(_vllm.layer_global_experts(layer)):
                to_global.setdefault(_vllm.layer_local_expert_id(layer, g), g)
            return [str(self._ckpt_name(layer, to_global.get(e, e), shard, kind)) for e, shard, kind in missing]

        def process_weights_after_loading(self, layer) -> None:
            if self.processed:
                # Called again with nothing loaded since: the parameters already hold the processed layout (act
                # order sorted by its g_idx, which keeps the checkpoint's order), and the runner is built on them.
                # Processing them again would sort sorted weights: a silently wrong layer.
                logger.debug("moe_wna16_plus: %s: already processed, nothing loaded since", self.prefix)
                return
            missing = self._missing(layer)
            if missing:
                more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
                raise ValueError(
                    f"moe_wna16_plus: the checkpoint is missing {len(missing)} tensor(s) of {layer.layer_name}: "
                    f"{', '.join(missing[:5])}{more} (is the checkpoint complete?)"
                )
            get = lambda gemm, kind: (
                getattr(layer, self.param_names[(gemm, kind)]) if (gemm, kind) in self.param_names else None
            )  # noqa: E731
            g13, g2 = get("w13", "g_idx"), get("w2", "g_idx")
            has_g_idx = False
            if self.scheme.desc_act:
                has_g_idx = not (self._trivial_g_idx(g13, self.shapes.group_size_w13) and self._trivial_g_idx(g2, None))
                if not has_g_idx:
                    logger.info("moe_wna16_plus: %s: desc_act g_idx is trivial; running without act order", self.prefix)
            w2_scales = get("w2", "scales").data
            w2_qzeros = get("w2", "qzeros").data if self.scheme.has_zero_point else None
            if self.scheme.desc_act and not has_g_idx and self.shapes.tp_size > 1:
                # act order keeps every group of the down projection on each rank (its g_idx names global
                # groups); dropped, this rank reads only its own: rows r*I_loc.. are groups r*G_loc..
                w2_scales, w2_qzeros = self._own_w2_groups(w2_scales, w2_qzeros)
            self.tensors = KernelTensors(
                w13_qweight=get("w13", "qweight").data,
                w2_qweight=get("w2", "qweight").data,
                w13_scales=get("w13", "scales").data,
                w2_scales=w2_scales,
                w13_qzeros=get("w13", "qzeros").data if self.scheme.has_zero_point else None,
                w2_qzeros=w2_qzeros,
                w13_g_idx=g13.data if has_g_idx else None,
                w2_g_idx=g2.data if has_g_idx else None,
            )
            issue, padded = None, False
            if has_g_idx:
                t = self.tensors
                issue = act_order_issue(t.w13_g_idx, t.w2_g_idx, t.w13_scales, t.w2_scales)
                # on a tensor-parallel rank the sorted groups are its shares of the groups (too few rows for the
                # CUDA kernel), padded or, by chance, whole: triton runs them either way
                padded = act_order_padded(t.w2_g_idx, t.w2_scales) or self.shapes.tp_size > 1
            p = self.problem
            if (has_g_idx, issue, padded) != (p.has_g_idx, p.act_order_issue, p.act_order_padded):
                self.problem = self._make_problem(layer, has_g_idx=has_g_idx, act_order_issue=issue,
                                                  act_order_padded=padded)  # fmt: skip
                self._select(layer)
            self._compose(layer)
            runner = self._build_runner()
            if self.runner is not None and self.runner.refresh_in_place(runner):
                # processed again after a reload (vLLM's reload_weights processes temporary parameters, then
                # copies them into the layer's own): the new weights go into the tensors the kernels and any
                # captured CUDA graphs read, and the temporary copies are not kept
                runner = self.runner
                self.tensors = runner.tensors
            elif self.runner is not None:
                before, after = _sorted_state(self.runner), _sorted_state(runner)
                if (
                    before is not None
                    and after is not None
                    and self.shapes.tp_size > 1
                    and (before.w2_qweight.shape != after.w2_qweight.shape)
                ):
                    # the layer's parameters hold the first load's padded layout, which vLLM's reload copies the
                    # new one into: another size cannot go there
                    raise ValueError(
                        f"moe_wna16_plus: {self.prefix}: the reloaded weights have another act order, which pads this "
                        f"tensor-parallel rank's down projection to {after.w2_qweight.shape[-1]} packed K columns "
                        f"instead of the loaded layer's {before.w2_qweight.shape[-1]}; a reload keeps the layer's "
                        "tensor shapes. Restart the engine with the new checkpoint instead of reloading it"
                    )
                logger.warning(
                    "moe_wna16_plus: %s: the reloaded layer's kernel state was rebuilt (its plan changed): CUDA graphs "
                    "captured before the reload read the old weights", self.prefix,
                )  # fmt: skip
            self.runner = runner
            sorted_state = _sorted_state(runner)
            if sorted_state is not None:
                # act order, sorted by the backend (backends.base.sort_act_order): the layer's parameters
                # take the sorted tensors so that one copy stays in memory (g_idx keeps the checkpoint's
                # order). On a tensor-parallel rank they are padded (other shapes than create_weights'):
                # vLLM's reload_weights (layerwise) restores the created shapes, loads, calls this again and
                # copies the result into these tensors; a plain load into them is refused by the loader.
                for (gemm, kind), name in self.param_names.items():
                    new = getattr(sorted_state, f"{gemm}_{kind}", None)
                    if kind in ("qweight", "scales", "qzeros") and new is not None:
                        getattr(layer, name).data = new
                self.tensors = sorted_state
            self.processed = True

        def _compose(self, layer) -> None:
            """Under auto, let vLLM's own kernel for the layer (compose.py: Humming where installed, else Marlin)
            take the batch sizes its rule says it runs faster, and the plugin's hopper kernel the ones its rule
            takes, each when its copy of the layer fits (compose.compose_decision)."""
            import os

            if self.selection.problem.options.compose_with or self.selection.problem.options.hopper:
                return
            device = self.tensors.w13_qweight.device
            utilization = getattr(self, "memory_utilization", _vllm.DEFAULT_GPU_MEMORY_UTILIZATION)
            added = 0  # bytes of the copies decided so far, not yet allocated
            partner, _ = compose.partner(self.selection)
            if partner is not None:
                copy = partner.copy_bytes(self.problem)
                free, total = torch.cuda.mem_get_info(device)
                used = torch.cuda.memory_reserved(device)
                composed, why = compose.compose_decision(
                    os.environ.get(partner.env), copy, used, free, total, utilization, partner.env
                )
                self._log_compose(partner.backend, partner.label, partner.env, composed, copy, why)
                if composed:
                    self.selection = compose.compose_with(self.selection, partner.backend)
                    self.problem = self.selection.problem
                    added = copy
            if compose.hopper_composable(self.selection, getattr(self, "max_batched_tokens", None)) is None:
                from vllm_wna16_plugin.backends.hopper import ENV_COMPOSE, hopper_copy_bytes

                copy = hopper_copy_bytes(self.problem)
                free, total = torch.cuda.mem_get_info(device)
                used = torch.cuda.memory_reserved(device) + added
                composed, why = compose.compose_decision(
                    os.environ.get(ENV_COMPOSE), copy, used, free - added, total, utilization, ENV_COMPOSE
                )
                self._log_compose("hopper", "the hopper kernel", ENV_COMPOSE, composed, copy, why)
                if composed:
                    self.selection = compose.with_hopper(self.selection)
                    self.problem = self.selection.problem

        def _log_compose(self, backend: str, label: str, env: str, composed: bool, copy: int, why: str) -> None:
            key = f"compose|{backend}|{self.problem.describe()}|{composed}"
            if key in _LOGGED:
                return
            _LOGGED.add(key)
            if composed:
                where, copy_word = (" (vLLM's default here)", "a second") if backend != "hopper" else ("", "another")
                logger.info(
                    "moe_wna16_plus: %s: the batch sizes %s runs faster (its rule in the plugin) run on %s%s; the "
                    "layer keeps %s copy of its experts in %s's layout (%.2f GiB; %s). %s=0 leaves it out.",
                    self.prefix, label, label, where, copy_word, label, copy / 2**30, why, env,
                )  # fmt: skip
            else:
                logger.info("moe_wna16_plus: %s: not composed with %s (%s)", self.prefix, label, why)

        def _build_runner(self) -> LayerRunner:
            """The layer's runner; a composed layer whose partner or hopper copy cannot be prepared (a compile or
            memory failure, say) leaves that copy out, with a warning: first the hopper copy, then the partner's, down
            to the plugin's kernels alone."""
            try:
                return LayerRunner(self.selection, self.tensors)
            except Exception as exc:  # noqa: BLE001 - a partner's prepare is not ours to trust at load
                options = self.selection.problem.options
                if not (options.compose_with or options.hopper):
                    raise
                dropped = "the hopper kernel" if options.hopper else compose.partner_named(options.compose_with).label
                keep = "its other copy" if options.hopper and options.compose_with else "the plugin's kernels alone"
                logger.warning(
                    "moe_wna16_plus: %s: %s could not be prepared (%s: %s); the layer runs %s where it ran",
                    self.prefix, dropped, type(exc).__name__, exc, keep,
                )  # fmt: skip
                change = dict(hopper=False) if options.hopper else dict(compose_with=None)
                problem = self.selection.problem
                plain = dataclasses.replace(problem, options=dataclasses.replace(problem.options, **change))
                self.selection = dataclasses.replace(self.selection, problem=plain)
                self.problem = plain
                return self._build_runner()

        def _own_w2_groups(self, scales: torch.Tensor, qzeros: torch.Tensor | None):
            """This rank's groups of the down projection's (E, H, G_full) scales and (E, H*bits/8, G_full)
            zero points, re-grouped to group_size_w2 (checkpoint_config.effective_group_size: it divides the
            checkpoint's group size): G_loc = I_loc / group_size_w2 of them from r * G_loc."""
            repeat = self.scheme.group_size // self.shapes.group_size_w2
            g_loc = self.shapes.intermediate_local // self.shapes.group_size_w2
            own = slice(self.shapes.tp_rank * g_loc, (self.shapes.tp_rank + 1) * g_loc)
            regroup = lambda t: t.repeat_interleave(repeat, dim=-1)[..., own].contiguous()  # noqa: E731
            return regroup(scales), None if qzeros is None else regroup(qzeros)

        def _trivial_g_idx(self, g_idx, group_size) -> bool:
            if g_idx is None:
                return True
            gs = group_size or self.scheme.group_size
            k = g_idx.shape[-1]
            offset = 0 if group_size else self.shapes.tp_rank * k
            expected = (torch.arange(k, device=g_idx.device, dtype=torch.int32) + offset) // gs
            return bool((g_idx == expected).all())

        # ---------------------------------------------------------------- backend

        def _make_problem(
            self, layer, *, has_g_idx: bool, act_order_issue: str | None = None, act_order_padded: bool = False
        ) -> MoEProblem:
            platform, sm = _vllm.platform_summary()
            return MoEProblem(
                scheme=self.scheme,
                hidden=self.shapes.hidden,
                intermediate=self.shapes.intermediate_local,
                num_experts=self.num_local_experts,
                global_num_experts=_vllm.layer_global_experts(layer),
                top_k=int(layer.top_k),
                group_size_w13=self.shapes.group_size_w13,
                group_size_w2=self.shapes.group_size_w2,
                act_dtype=self.params_dtype,
                activation=_vllm.layer_activation(layer),
                platform=platform,
                sm=sm,
                has_g_idx=has_g_idx,
                act_order_issue=act_order_issue,
                act_order_padded=act_order_padded,
                use_ep=layer.expert_map is not None,
                apply_router_weight_on_input=bool(layer.apply_router_weight_on_input),
            )

        def _select(self, layer) -> None:
            import os

            from vllm_wna16_plugin.kernels.triton.td_gate import td_request_from_env
            from vllm_wna16_plugin.user_tables import use_tuned

            # the plugin's variables: a bad value is refused before any weight is read, not at the first forward
            compose.check_settings(os.environ)
            td_request_from_env()
            use_tuned()
            if not hasattr(self, "memory_utilization"):  # read in create_weights, inside the engine's config
                self.memory_utilization = _vllm.gpu_memory_utilization()
                self.max_batched_tokens = _vllm.max_batched_tokens()
            requested, source = resolve_request(_vllm.layer_moe_backend(layer))
            self.selection = select_backend(self.problem, requested, source)
            self.problem = self.selection.problem  # as judged: options.explicit says whether it was named
            key = f"{self.problem.describe()}|{requested}|{self.selection.backend.name}"
            if key not in _LOGGED:
                _LOGGED.add(key)
                logger.info("%s\n  (first layer of this type: %s)", self.selection.explain(), self.prefix)

        def get_fused_moe_quant_config(self, layer):
            return _vllm.fused_moe_quant_config(
                self.scheme.bits,
                getattr(layer, self.param_names[("w13", "scales")]),
                getattr(layer, self.param_names[("w2", "scales")]),
                None,
                None,
                self.shapes.group_size_w13,
            )

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
            return self.runner.run(x, topk_weights, topk_ids, layer.expert_map)

    return MoeWNA16PlusMethod()
