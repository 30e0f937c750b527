"""Macros for LLMs shipped with neuronbuild:
load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets", "llm_compile")."""

_GRAPHS_MODULE = "neuronbuild.toolchains.hf_causal_lm"
_BLOCK_MODULE = "neuronbuild.toolchains.hf_block_kv"  # (a module of its own: hf_causal_lm.py's digest is in every trace)

def _field(config, names, default = None):
    for n in names:
        if n in config and config[n] != None:
            return config[n]
    if default == None:
        fail("hf_causal_lm: config needs one of %s" % ", ".join(names))
    return default

def _kv_heads(model_type, config, heads):
    """Key/value heads as each family's transformers attention reads them (MQA/GQA under their own key names)."""
    if model_type == "falcon":
        # FalconAttention: num_kv_heads with the new decoder architecture or without multi_query, else one
        if config.get("new_decoder_architecture", False) or not config.get("multi_query", True):
            return _field(config, ["num_kv_heads"], heads)
        return 1
    if model_type == "gpt_bigcode":
        return 1 if config.get("multi_query", True) else heads
    return _field(config, ["num_key_value_heads", "num_kv_heads", "multi_query_group_num"], heads)

# Analysis-time sanity (a model no host could hold fails here, naming the field, not after its traces ran for hours):
# the largest served LLMs have ~126 layers (Llama-3.1-405B) and ~0.7T parameters (DeepSeek-V3).
MAX_LAYERS = 1024
MAX_PARAMS = 10 * 1000 * 1000 * 1000 * 1000  # 10T

def _positive(name, field, value):
    if type(value) != "int" or value <= 0:
        fail("hf_causal_lm %s: config field %s must be a positive int, got %r" % (name, field, value))
    return value

def _check_size(name, config, layers, hidden, heads, kv_heads, head_dim, max_seq):
    """Fails for shapes no host could hold or that are inconsistent, naming the field."""
    _positive(name, "num_key_value_heads", kv_heads)
    _positive(name, "head_dim", head_dim)
    _positive(name, "max_seq", max_seq)
    if heads % kv_heads:
        fail("hf_causal_lm %s: config field num_key_value_heads (%d) must divide num_attention_heads (%d)" % (
            name, kv_heads, heads))
    if layers > MAX_LAYERS:
        fail(("hf_causal_lm %s: config field num_hidden_layers is %d, more than %d (the largest served models have " +
              "~126); no host could build or serve it") % (name, layers, MAX_LAYERS))
    vocab = _positive(name, "vocab_size", config.get("vocab_size", 32000))
    inter = config.get("intermediate_size") or config.get("n_inner") or 4 * hidden
    _positive(name, "intermediate_size", inter)
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 1
    _positive(name, "num_experts", experts)
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    params = 2 * vocab * hidden + layers * (attn + 3 * hidden * inter * experts)
    if params > MAX_PARAMS:
        fail(("hf_causal_lm %s: the config describes ~%d billion parameters (hidden_size %d, num_hidden_layers %d, " +
              "vocab_size %d), more than any host could hold") % (name, params // 1000000000, hidden, layers, vocab))

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32", "bf16": "bfloat16",
           "fp16": "float16", "float": "float32", "half": "float16"}

def _dtype(name, config, dtype):
    """The dtype the model computes in (weights, activations, KV cache): `dtype` if given, else the config's
    `dtype` / `torch_dtype` (as transformers reads it), else float32."""
    d = dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    if type(d) != "string" or d.replace("torch.", "") not in _DTYPES:
        fail("hf_causal_lm %s: dtype %r is not supported (float32, bfloat16 or float16)" % (name, d))
    return _DTYPES[d.replace("torch.", "")]

_QUANT_KEYS = ["dtype", "scheme", "block_size", "modules_to_not_convert"]
_QUANT_DTYPES = ["int8", "float8_e4m3", "float8_e5m2"]
_QUANT_SCHEMES = ["per_tensor", "per_channel", "blockwise"]

def _quantization(name, q):
    """hf_causal_lm's `quantization` checked and normalised (docs/quantization.md): dtype, scheme (default
    per_channel), block_size (blockwise only), modules_to_not_convert (name patterns kept in the model dtype)."""
    if type(q) != "dict":
        fail("hf_causal_lm %s: quantization must be a dict with keys %s" % (name, ", ".join(_QUANT_KEYS)))
    for k in q:
        if k not in _QUANT_KEYS:
            fail("hf_causal_lm %s: quantization: unknown key %r (known: %s)" % (name, k, ", ".join(_QUANT_KEYS)))
    dt = q.get("dtype")
    if dt not in _QUANT_DTYPES:
        fail("hf_causal_lm %s: quantization dtype %r is not one of %s" % (name, dt, ", ".join(_QUANT_DTYPES)))
    scheme = q.get("scheme") or "per_channel"
    if scheme not in _QUANT_SCHEMES:
        fail("hf_causal_lm %s: quantization scheme %r is not one of %s" % (name, scheme, ", ".join(_QUANT_SCHEMES)))
    out = {"dtype": dt, "scheme": scheme}
    block = q.get("block_size")
    if scheme == "blockwise":
        if type(block) != "int" or block < 1:
            fail("hf_causal_lm %s: quantization scheme blockwise needs a positive int block_size, got %r" % (name, block))
        out["block_size"] = block
    elif block != None:
        fail("hf_causal_lm %s: quantization block_size is for scheme blockwise only (scheme is %s)" % (name, scheme))
    skip = q.get("modules_to_not_convert") or []
    if type(skip) != "list" or [s for s in skip if type(s) != "string" or not s]:
        fail("hf_causal_lm %s: quantization modules_to_not_convert must be a list of module name patterns" % name)
    if skip:
        out["modules_to_not_convert"] = skip
    return out

def _serving_graphs(name, kv, max_seq, max_batch, on_device_sampling, output_logits):
    """continuous_batching graphs, in NxD Inference's input order (docs/llm.md "Serving")."""
    if type(max_batch) != "int" or max_batch < 1:
        fail("hf_causal_lm %s: continuous_batching needs max_batch = N >= 1 (the KV cache's sequence slots)" % name)
    extra = {"sampling_params": "float32[batch, 3]", "rand": "float32[batch]"} if on_device_sampling else {}
    outputs = {"tokens": "int32[batch]"} if on_device_sampling else {}
    if output_logits or not on_device_sampling:
        outputs["logits"] = "float32[batch, vocab]"
    outputs["kv"] = kv
    kind = ("sampling_logits_" if output_logits else "sampling_") if on_device_sampling else "serving_"
    graphs = {}
    for graph, mask, positions in (("context", "seq", "seq"), ("token", "max_seq", "1")):
        inputs = {
            "input_ids": "int32[batch, %s]" % ("seq" if graph == "context" else "1"),
            "attention_mask": "int32[batch, %s]" % mask,
            "position_ids": "int32[batch, %s]" % positions,
            "seq_ids": "int32[batch]",
        }
        inputs.update(extra)
        inputs["kv"] = kv
        graphs[graph] = {"entry": _GRAPHS_MODULE + ":" + kind + graph, "inputs": inputs, "outputs": outputs,
                         "aliases": {"kv": "kv"}}
    return graphs

_KV_LAYOUTS = ["contiguous", "block"]

def _block_layout(name, kv_layout, block_size, num_blocks, max_seq, continuous_batching, speculation, kv_cache_dtype):
    """hf_causal_lm's kv_layout / block_size / num_blocks checked: None (the contiguous layout, whose graphs are those
    built without the attributes) or {"block_size": B, "num_blocks": N} (docs/llm.md "Block KV cache")."""
    if kv_layout == None or kv_layout == "contiguous":
        if block_size != None or num_blocks != None:
            fail("hf_causal_lm %s: block_size and num_blocks need kv_layout = \"block\"" % name)
        return None
    if kv_layout not in _KV_LAYOUTS:
        fail("hf_causal_lm %s: kv_layout %r is not one of %s" % (name, kv_layout, ", ".join(_KV_LAYOUTS)))
    if not continuous_batching:
        fail("hf_causal_lm %s: kv_layout = \"block\" needs continuous_batching = True (the engine hands out the blocks)" % name)
    if speculation != None:
        fail("hf_causal_lm %s: kv_layout = \"block\" with speculation is not supported yet (the verify graph reads cache lines)" % name)
    if kv_cache_dtype != None:
        fail("hf_causal_lm %s: kv_layout = \"block\" with kv_cache_dtype is not supported yet (the block pool is held in the model dtype)" % name)
    if type(block_size) != "int" or block_size < 1 or max_seq % block_size:
        fail("hf_causal_lm %s: kv_layout = \"block\" needs block_size = B, a positive int dividing max_seq (%d), got %r" % (
            name, max_seq, block_size))
    if type(num_blocks) != "int" or num_blocks < 1:
        fail("hf_causal_lm %s: kv_layout = \"block\" needs num_blocks = N >= 1 (the KV pool's blocks), got %r" % (name, num_blocks))
    return {"block_size": block_size, "num_blocks": num_blocks}

def _block_graphs(graphs, layout, prefix_caching):
    """The continuous-batching graphs over a block pool: a per-row `block_table` int32[batch, blocks_per_seq] where
    seq_ids stood, the `block_*` entries, the layout in each graph's config (its fingerprint and the bundle's record).
    prefix_caching adds the `prefix` family: the context graph's signature over `seq` new tokens after up to `prefix`
    cached positions (2-D buckets batch x seq x prefix, NxD Inference's prefix buckets), which `prefix_mask`
    int32[batch, prefix] marks (1 = a cached position of the row, read from its blocks)."""
    out = {}
    for family, g in graphs.items():
        inputs = {}
        for k, v in g["inputs"].items():
            if k == "seq_ids":
                inputs["block_table"] = "int32[batch, blocks_per_seq]"
            else:
                inputs[k] = v
        out[family] = {"entry": _BLOCK_MODULE + ":block_" + g["entry"].split(":")[1], "inputs": inputs, "outputs": g["outputs"],
                       "aliases": g["aliases"], "config": {"kv_layout": {"kind": "block"} | layout}}
    if prefix_caching:
        ctx = out["context"]
        inputs = {}
        for k, v in ctx["inputs"].items():
            inputs[k] = v
            if k == "block_table":
                inputs["prefix_mask"] = "int32[batch, prefix]"
        out["prefix"] = {"entry": ctx["entry"].replace("_context", "_prefix"), "inputs": inputs, "outputs": ctx["outputs"],
                         "aliases": ctx["aliases"], "config": ctx["config"]}
    return out

_SPEC_KEYS = ["draft", "length", "fused"]

def _speculation(name, spec):
    """hf_causal_lm's `speculation` checked and normalised: {"draft": the draft hf_causal_lm's label (absolute),
    "length": k >= 1, "fused": bool}."""
    if type(spec) != "dict":
        fail("hf_causal_lm %s: speculation must be a dict with keys %s" % (name, ", ".join(_SPEC_KEYS)))
    for k in spec:
        if k not in _SPEC_KEYS:
            fail("hf_causal_lm %s: speculation: unknown key %r (known: %s)" % (name, k, ", ".join(_SPEC_KEYS)))
    draft = spec.get("draft")
    if type(draft) != "string" or not (draft.startswith(":") or draft.startswith("//")) or draft.endswith(":"):
        fail("hf_causal_lm %s: speculation draft must be the label of another hf_causal_lm (\":small_lm\" or " % name +
             "\"//pkg:small_lm\"), got %r" % (draft,))
    if draft.startswith(":"):
        draft = "//" + package_name() + draft
    if draft == "//" + package_name() + ":" + name:
        fail("hf_causal_lm %s: speculation draft is the model itself" % name)
    k = spec.get("length")
    if type(k) != "int" or k < 1 or k > 64:
        fail("hf_causal_lm %s: speculation length must be an int in 1..64 (draft tokens per target call), got %r" % (name, k))
    fused = spec.get("fused", False)
    if type(fused) != "bool":
        fail("hf_causal_lm %s: speculation fused must be True or False, got %r" % (name, fused))
    return {"draft": draft, "length": k, "fused": fused}

def _speculation_graph(kv, spec, on_device_sampling, output_logits):
    """The target's verification graph (`verify`): the last accepted token and k draft tokens per row (k + 1
    positions), written into the row's cache line like the token graph, returning the target's token at each position.
    With speculation fused = True, the `fused` graph instead: the draft's k steps (fed 2 positions, `draft_tokens`,
    `draft_rand`, `draft_logits`) and the target's verification in one call. Its draft cache `draft_kv` (input and
    output, after `kv`) is declared at analysis as the draft's token graph declares its cache, and the draft's config
    enters the graph's config as `speculation_draft` (kinds/model.py): the draft's identity and shapes are in this
    graph's fingerprint alone."""
    k, fused = spec["length"], spec["fused"]
    fed = 2 if fused else k + 1
    inputs = {
        "input_ids": "int32[batch, %d]" % fed,
        "attention_mask": "int32[batch, max_seq]",
        "position_ids": "int32[batch, %d]" % fed,
        "seq_ids": "int32[batch]",
    }
    if on_device_sampling:
        inputs.update({"sampling_params": "float32[batch, 3]", "rand": "float32[batch, %d]" % (k + 1)})
        if fused:
            inputs["draft_rand"] = "float32[batch, %d]" % k
    inputs["kv"] = kv
    outputs = {"draft_tokens": "int32[batch, %d]" % k} if fused else {}
    outputs["tokens"] = "int32[batch, %d]" % (k + 1)
    if output_logits or not on_device_sampling:
        if fused:
            outputs["draft_logits"] = "float32[batch, %d, vocab]" % k
        outputs["logits"] = "float32[batch, %d, vocab]" % (k + 1)
    outputs["kv"] = kv
    kind = ("sampling_logits_" if output_logits else "sampling_") if on_device_sampling else "serving_"
    # the speculation enters this graph's config (its fingerprint and the bundle's record) and no other graph's
    return {"entry": _GRAPHS_MODULE + ":" + kind + ("fused" if fused else "verify"), "inputs": inputs,
            "outputs": outputs, "aliases": {"kv": "kv"}, "config": {"speculation": spec}}

def hf_causal_lm(name, config, weights = None, max_seq = 256, model_type = None, weights_prefix = "", dtype = None,
                 continuous_batching = False, max_batch = None, on_device_sampling = False, output_logits = False,
                 quantization = None, kv_cache_dtype = None, speculation = None, kv_layout = None, block_size = None,
                 num_blocks = None, prefix_caching = False, moe_ep_degree = None, moe_tp_degree = None, tags = []):
    """A transformers causal LM (llama, mistral, qwen2, gpt2, ...) as served: a `context` graph (prefill: input_ids and
    attention_mask [batch, seq] -> last logits + the KV cache) and a `token` graph (decode: one token per sequence,
    its position, the cache mask and slot, the cache -> logits + the cache, aliased), over a static KV cache of
    max_seq slots, sharing one weights file. `config` holds HF config fields (model_type included or given).
    `dtype` (float32, bfloat16, float16) is what the weights, activations and KV cache are held in: by default the
    config's `dtype` / `torch_dtype`, else float32. Logits are float32 whatever the dtype. `quantization`
    ({"dtype", "scheme", "block_size", "modules_to_not_convert"}): weight-only int8 / fp8 decoder linear layers,
    quantized from the checkpoint by the weights action (or read pre-quantized); `kv_cache_dtype = "float8_e4m3"`:
    the KV cache held in fp8 (cast as written, read back in the model dtype): docs/quantization.md.
    Serving (docs/llm.md "Serving"): `continuous_batching = True` with `max_batch = N` makes both graphs take
    (input_ids, attention_mask, position_ids, seq_ids[, sampling_params, rand], kv) over a cache of N sequence lines
    (+ one scratch line for padding rows); `on_device_sampling = True` returns the sampled `tokens` (int32 [batch])
    instead of the logits (`output_logits = True`: both). They change the graphs' traces only, never the weights.
    `weights = None`: graphs only (docs/models.md "Graphs without weights"): the compiles need no checkpoint and ship
    no weights; a `model_weights(model = ":<name>", weights = <checkpoint>)` target supplies them to a bundle.
    `speculation = {"draft": ":small_lm", "length": k, "fused": False}` (needs continuous_batching; docs/llm.md
    "Speculative decoding"): adds the `verify` graph family (k + 1 positions per row against the cache); the draft
    is another hf_causal_lm with continuous_batching, compiled and bundled on its own. `fused = True` adds the
    `fused` family instead: the draft's k steps and the verification in one graph binding both models' weights.
    `kv_layout = "block"` with `block_size = B` (dividing max_seq) and `num_blocks = N` (needs continuous_batching;
    docs/llm.md "Block KV cache"): the cache is a pool of N blocks of B positions (+ one scratch block) and the
    graphs take a per-row `block_table` instead of seq_ids; max_batch is then optional (the engine's cap on active
    sequences). Without kv_layout (or "contiguous") the graphs are exactly those built without it.
    `moe_ep_degree = E`, `moe_tp_degree = T` (mixture-of-experts families, NxD Inference's): at tp_degree E x T the
    ranks form E expert-parallel groups of T ranks, each group holding E-th of the experts, each expert's width split
    over its group's T ranks (docs/llm.md "Expert parallelism"); one written, the other is tp_degree divided by it;
    neither, each expert is split by width over every rank. tp_degree 1 ignores them.
    `prefix_caching = True` (block layout only) adds the `prefix` graph family, bucketed over batch x seq (new tokens)
    x prefix (cached positions read from the blocks): a prefill computing only what follows a cached prefix, and the
    chunks of a prompt longer than the largest context bucket."""
    if speculation != None and not continuous_batching:
        fail("hf_causal_lm %s: speculation needs continuous_batching = True (the engine speculates per request)" % name)
    if not continuous_batching:
        if max_batch != None or on_device_sampling or output_logits:
            fail("hf_causal_lm %s: max_batch, on_device_sampling and output_logits need continuous_batching = True" % name)
    elif output_logits and not on_device_sampling:
        fail("hf_causal_lm %s: output_logits is for on_device_sampling graphs (the others return logits)" % name)
    mt = model_type or _field(config, ["model_type"])
    for key, degree in (("moe_ep_degree", moe_ep_degree), ("moe_tp_degree", moe_tp_degree)):
        if degree != None and (type(degree) != "int" or degree <= 0):
            fail("hf_causal_lm %s: %s must be a positive int, got %r" % (name, key, degree))
    dt = _dtype(name, config, dtype)
    for lt in config.get("layer_types") or []:
        if lt not in ("full_attention", "sliding_attention", "chunked_attention"):
            fail("hf_causal_lm %s: config field layer_types: %r is not supported (full_attention, sliding_attention and chunked_attention are)" % (name, lt))
    layers = _positive(name, "num_hidden_layers", _field(config, ["num_hidden_layers", "n_layer"]))
    heads = _positive(name, "num_attention_heads", _field(config, ["num_attention_heads", "n_head"]))
    hidden = _positive(name, "hidden_size", _field(config, ["hidden_size", "n_embd"]))
    kv_heads = _kv_heads(mt, config, heads)
    head_dim = _field(config, ["head_dim"], hidden // heads)
    _check_size(name, config, layers, hidden, heads, kv_heads, head_dim, max_seq)
    cache_heads, cache_width = kv_heads, head_dim
    if mt == "falcon" and config.get("new_decoder_architecture", False):
        cache_heads = heads  # FalconAttention broadcasts each kv group's k and v to its query heads before the cache update
    if config.get("kv_lora_rank"):  # multi-head latent attention: one latent line per token (hf_causal_lm.cache_width)
        if mt in ("deepseek_v2", "deepseek_v3") and "qk_rope_head_dim" not in config:
            fail("hf_causal_lm %s: config field qk_rope_head_dim: a latent-attention config must write it (the cache holds the rotary key beside the kv_lora_rank latent)" % name)
        cache_heads = 1
        cache_width = max(_positive(name, "kv_lora_rank", config["kv_lora_rank"]), config.get("qk_rope_head_dim", 0))
    elif mt in ("deepseek_v2", "deepseek_v3"):
        fail("hf_causal_lm %s: config field kv_lora_rank: a %s config must write it (the width of its latent KV cache)" % (name, mt))
    hf = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype", "dtype")}
    if dt != "float32":  # (float32 is transformers' default: such configs stay as they were)
        hf["dtype"] = dt
    if kv_cache_dtype not in (None, "float8_e4m3"):
        fail("hf_causal_lm %s: kv_cache_dtype %r is not supported (float8_e4m3, or None: the model dtype)" % (name, kv_cache_dtype))
    kv = ("float8_e4m3fn" if kv_cache_dtype else dt) + "[layers, 2, batch, kv_heads, max_seq, head_dim]"
    dims = {"layers": layers, "kv_heads": cache_heads, "max_seq": max_seq, "head_dim": cache_width}
    ranges = {"slot": [0, max_seq], "position_ids": [0, max_seq]}
    graphs = {
        "context": {},
        "token": {
            "entry": _GRAPHS_MODULE + ":token",
            "inputs": {
                "input_ids": "int64[batch, 1]",
                "position_ids": "int64[batch, 1]",
                "cache_mask": "int64[batch, max_seq]",
                "slot": "int64[1]",
                "kv": kv,
            },
            "outputs": {"logits": "float32[batch, vocab]", "kv": kv},
            "aliases": {"kv": "kv"},
        },
    }
    layout = _block_layout(name, kv_layout, block_size, num_blocks, max_seq, continuous_batching, speculation, kv_cache_dtype)
    if prefix_caching and layout == None:
        fail("hf_causal_lm %s: prefix_caching = True needs kv_layout = \"block\" (cached prefixes are shared blocks)" % name)
    if layout != None:
        dims = dims | {"blocks": num_blocks + 1, "block_size": block_size, "blocks_per_seq": max_seq // block_size}
        ranges = {"position_ids": [0, max_seq], "block_table": [0, num_blocks + 1], "attention_mask": [1, 2]}
        pool = kv.replace("[layers, 2, batch, kv_heads, max_seq, head_dim]", "[layers, 2, blocks, kv_heads, block_size, head_dim]")
        if max_batch != None:  # the engine's cap on active sequences (recorded; the graphs' shapes do not hold it)
            _positive(name, "max_batch", max_batch)
            layout["max_batch"] = max_batch
        if type(prefix_caching) != "bool":
            fail("hf_causal_lm %s: prefix_caching must be True or False, got %r" % (name, prefix_caching))
        if prefix_caching:
            ranges["prefix_mask"] = [1, 2]
        graphs = _block_graphs(_serving_graphs(name, pool, max_seq, max_batch or 1, on_device_sampling, output_logits), layout,
                               prefix_caching)
    elif continuous_batching:
        dims["lines"] = max_batch + 1
        ranges = {"position_ids": [0, max_seq], "seq_ids": [0, max_batch], "attention_mask": [1, 2]}
        graphs = _serving_graphs(name, kv.replace("[layers, 2, batch,", "[layers, 2, lines,"), max_seq, max_batch,
                                 on_device_sampling, output_logits)
        if speculation != None:
            spec = _speculation(name, speculation)
            graphs["fused" if spec["fused"] else "verify"] = _speculation_graph(graphs["token"]["inputs"]["kv"], spec,
                                                                                on_device_sampling, output_logits)
    neuron_model(
        name = name,
        entry = _GRAPHS_MODULE + ":context",
        config = {"model_type": mt, "hf": hf, "max_seq": max_seq} |
                 ({"quantization": _quantization(name, quantization)} if quantization != None else {}) |
                 ({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}) |
                 ({"moe_ep_degree": moe_ep_degree} if moe_ep_degree != None else {}) |
                 ({"moe_tp_degree": moe_tp_degree} if moe_tp_degree != None else {}),
        weights = weights,
        weights_prefix = weights_prefix,
        graphs_only = weights == None,
        dims = dims,
        inputs = {"input_ids": "int64[batch, seq]", "attention_mask": "int64[batch, seq]"},
        outputs = {"logits": "float32[batch, vocab]", "kv": kv},
        # validate's random values: cache slots and positions inside the cache
        input_ranges = ranges,
        graphs = graphs,
        tags = tags,
    )

def llm_buckets(name, batch_sizes, context_lengths, decode = True, tags = []):
    """As NxD Inference's context_encoding_buckets / token_generation_buckets: `<name>_context` (every batch size x
    context length) and `<name>_token` (every batch size) for an hf_causal_lm's graphs, plus `<name>` itself, the
    plain-model form: the context shapes and, with decode, a seq = 1 bucket per batch size."""
    if not batch_sizes or not context_lengths:
        fail("llm_buckets: batch_sizes and context_lengths must be non-empty")
    shapes = [{"batch": b, "seq": s} for b in batch_sizes for s in context_lengths]
    neuron_buckets(name = name + "_context", shapes = shapes, tags = tags)
    neuron_buckets(name = name + "_token", shapes = [{"batch": b} for b in batch_sizes], tags = tags)
    if decode:
        shapes = shapes + [{"batch": b, "seq": 1} for b in batch_sizes if 1 not in context_lengths]
    neuron_buckets(name = name, shapes = shapes, tags = tags)

def llm_compile(name, model, buckets, targets, options = None, tags = []):
    """One neuron_compile per target, named <name>_<target name> (e.g. llama_trn2, llama_cpu). `buckets` and
    `options` may be dicts keyed by graph family ({"context": [...], "token": [...]})."""
    if not targets:
        fail("llm_compile: targets must be non-empty")
    for t in targets:
        short = t.split(":")[-1] if ":" in t else t.split("/")[-1]
        neuron_compile(
            name = "%s_%s" % (name, short),
            model = model,
            buckets = buckets,
            target = t,
            options = options,
            tags = tags,
        )
