"""The one settings model every service reads (env prefix ``DIFFSPEC_``, CLI flags derived from it).

Defaults run the bundled demo pair (``models/tiny-code`` and its EAGLE-3 head) on the CPU, so a
fresh checkout works without any configuration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED_TARGET = REPO_ROOT / "models" / "tiny-code"
BUNDLED_DRAFT = REPO_ROOT / "models" / "tiny-code-eagle3"
SHARED_DIR = REPO_ROOT.parent / "shared"
DraftQuantization = Literal["none", "int8", "auto"]  # draft_service/serving_weights.py says what each does


class DiffSpecSettings(BaseSettings):
    """Everything a deployment can tune; each field is also a ``--flag`` of the CLI."""

    model_config = SettingsConfigDict(env_prefix="DIFFSPEC_", extra="forbid")

    # Models
    base_model: Path = Field(BUNDLED_TARGET, description="Target checkpoint directory (Hugging Face Llama layout).")
    draft_model: Path = Field(BUNDLED_DRAFT, description="EAGLE-3 head directory (published layout).")
    device: str = Field("auto", description="torch device for the models: auto, cpu, cuda, cuda:N.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight/activation dtype; auto = float32 on CPU, bfloat16 on GPU."
    )
    feature_layers: str = Field(
        "auto",
        description="Comma-separated target layers whose residual-stream inputs feed EAGLE-3; "
        "auto = 2, L//2, L-3 (evenly spaced when the model has under 8 layers).",
    )

    # Target runtime
    page_size: int = Field(16, ge=1, description="Tokens per KV page.")
    num_pages: int = Field(4096, ge=1, description="Pages in the target's KV pool.")
    max_context: int = Field(0, ge=0, description="Longest prompt + generation in tokens; 0 = the model's limit.")
    prefill_chunk: int = Field(2048, ge=1, description="Prompt tokens per prefill forward (bounds activation memory).")
    attention_backend: Literal["auto", "torch", "triton", "flash-attn"] = Field(
        "auto", description="Attention implementation for the target's paged KV; auto = triton on a GPU, torch on CPU."
    )
    cuda_graphs: bool = Field(
        True,
        description="Replay the target's verify and decode steps from CUDA graphs, one per (batch, tree size) "
        "bucket (GPU with the triton backend; other steps run eagerly), and the draft head's steps on a GPU.",
    )
    warm_up: bool = Field(
        True,
        description="Before serving: record every step graph of the target and run one proposal of each tree "
        "the draft's policies start from, so kernel compiles and graph captures do not land in a request.",
    )
    graph_batch_sizes: str = Field("1,2,4,8,16", description="Comma-separated batch-size buckets of the step graphs.")
    graph_tree_sizes: str = Field(
        "1,8,16,32,64,128,256", description="Comma-separated tree-size buckets (new tokens per sequence) of the step graphs."
    )

    # Drafting
    policy: str = Field("full", description="Tree policy: auto, chain, uniform<K>, full, online.")
    tree_config: str = Field("64:0.08:8", description="Tree budget total_tokens:threshold:depth.")
    salience: bool = Field(False, description="Draft attends to a salience-selected working set of chunks.")
    draft_quantization: DraftQuantization = Field(
        "none",
        description="Weights of the draft head's per-depth matmuls: none = the head's dtype; int8 = per-output-"
        "channel int8, activations in dtype (half the bytes a draft depth reads from a bf16 head); auto = int8 "
        "for the large matrices at up to 16 rows (one session's frontier), the dtype otherwise, where each "
        "measured faster. Output is lossless either way (the target verifies every token); int8 may cost some "
        "acceptance.",
    )
    accept_on_device: bool = Field(
        True,
        description="With the draft and the target in one process: a greedy verify's accepted entries are written "
        "to the draft from the device's acceptance while the verify runs, and checked against the host's when it "
        "has read the results (off: the draft commits them after the results, as across processes).",
    )
    propose_ahead: bool = Field(
        True,
        description="With accept_on_device: when every draft session's accepted entries were written so, the next "
        "proposal is queued behind them at once, so the GPU runs it while the host reads the verify's results "
        "(off: the next step proposes after the results). The same trees either way.",
    )
    draft_prefix_cache_tokens: int = Field(
        -1, ge=-1,
        description="Prompt and generated entries the draft's prefix cache keeps after their request ends, in blocks "
        "of 64, per cache scope (the client): a prompt that starts with cached blocks takes them instead of the "
        "target's features, and the target's own prefix cache then skips those positions' forward too. Memory on "
        "the draft's device: 2 x layers x KV heads x head dim x dtype bytes a token (4 KiB for a Llama-3.1-8B "
        "EAGLE-3 head in bf16, 1/32 of the target's 128 KiB). -1 = as many as the KV pool holds tokens "
        "(num_pages x page_size; a draft service of its own reads them from its own settings, so give it the "
        "target's), so that what the target keeps cached the draft can keep too; 0 = off.",
    )
    tuning_profile: str = Field(
        "",
        description="tuned_profile.json written by python -m bench.reproduce: a request that sets no policy, tree "
        "config or salience takes those tuned at the context nearest its prompt length (replacing policy, "
        "tree_config and salience as defaults); checked at start; empty = none.",
    )
    chunk_size: int = Field(64, ge=1, description="Context tokens per salience chunk.")
    working_set_tokens: int = Field(2048, ge=64, description="Token budget of the draft's working set.")
    salience_recent_tokens: int = Field(
        0, ge=0,
        description="Most recent context tokens always in the working set; 0 = three quarters of working_set_tokens "
        "(fewer when the sink chunks leave no room for them).",
    )
    salience_reselect_every: int = Field(8, ge=1, description="Draft steps between scheduled working-set re-selections.")
    salience_min_overlap: float = Field(
        0.75, ge=0.0, le=1.0,
        description="Re-select the working set early when the best-scoring chunks share less than this fraction "
        "with the chosen ones (0 = only every salience_reselect_every steps; each change costs an arena update).",
    )
    salience_compact_positions: bool = Field(
        True,
        description="Re-rope the working set's chunks to follow one another up to its newest chunk, which keeps its "
        "positions, so the draft sees a working set of working_set_tokens as a context that long (a head trained on "
        "short windows never saw the distances of a long one: bench/RESULTS.md measures the gain); each change of "
        "the set restages its arena whole.",
    )

    # Generation defaults
    max_new_tokens: int = Field(
        128,
        ge=1,
        description="Default number of tokens to generate, where the target checkpoint's generation_config.json "
        "gives none (see generation_config).",
    )
    generation_config: Literal["auto", "none"] = Field(
        "auto",
        description="auto = a request that leaves temperature, top_p or top_k unset takes the target "
        "checkpoint's generation_config.json value (when that file sets do_sample: true), and one that leaves "
        "max_new_tokens unset the file's max_new_tokens within the context the prompt leaves, as vLLM's "
        "--generation-config auto; none = DiffSpec's own defaults (greedy over gRPC and the CLI, OpenAI's "
        "temperature 1 over HTTP; top_p 1, top_k 0, max_new_tokens). The file's EOS list applies either way.",
    )

    # Services
    listen: str = Field("127.0.0.1:50051", description="Address this server listens on.")
    http_listen: str = Field(
        "",
        description="host:port of the OpenAI-compatible HTTP API that serve all|gateway runs beside gRPC "
        "(e.g. 127.0.0.1:8000; port 0 picks one; empty = off).",
    )
    target_address: str = Field("", description="Remote target service host:port (empty = in process).")
    draft_address: str = Field("", description="Remote draft service host:port (empty = in process).")
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=65536, description="Largest gRPC message sent or received.")
    max_sessions: int = Field(
        64,
        ge=1,
        description="Generations admitted at once, running or queued until the KV pool can hold their prompt + "
        "max_new_tokens, before RESOURCE_EXHAUSTED.",
    )
    client_max_requests: int = Field(
        0,
        ge=0,
        description="Generations one client (its x-diffspec-client header, else its host) may have admitted at "
        "once before RESOURCE_EXHAUSTED; 0 = no per-client cap.",
    )
    client_max_tokens: int = Field(
        0,
        ge=0,
        description="Prompt + max_new_tokens summed over one client's admitted generations before "
        "RESOURCE_EXHAUSTED; 0 = no per-client cap.",
    )
    max_batch_tokens: int = Field(
        4096, ge=1, description="Tokens one engine iteration computes: every tree first, then prompt chunks."
    )
    metrics_port: int = Field(0, ge=0, description="Prometheus metrics HTTP port (0 = off).")
    keepalive_seconds: float = Field(
        30.0, gt=0, description="HTTP/2 keepalive ping interval of servers and channels (finds dead idle peers)."
    )
    keepalive_timeout_seconds: float = Field(
        10.0, gt=0, description="A keepalive ping unanswered this long drops the link."
    )
    shutdown_grace_seconds: float = Field(
        10.0, ge=0, description="On SIGTERM/SIGINT, how long in-flight streams may finish before they are cancelled."
    )
    step_timeout_seconds: float = Field(
        120.0, gt=0, description="How long the gateway waits for a remote target's or draft's reply to one step."
    )
    draft_timeout_seconds: float = Field(
        1.0,
        gt=0,
        description="How long the gateway waits for a remote draft's proposals in one step (a few verify steps' "
        "worth): past it that step verifies Auto trees at once, and later steps ask the draft again once it has "
        "answered. A draft behind for step_timeout_seconds is dropped (its requests finish with Auto).",
    )
    peer_health_seconds: float = Field(
        2.0,
        gt=0,
        description="How often a gateway with a remote target asks whether the target answers; its health and "
        "/ready say NOT_SERVING / 503 while it does not.",
    )
    peer_wait_seconds: float = Field(
        120.0, gt=0, description="How long a starting gateway waits for a remote target to answer before giving up."
    )
    tokenize_threads: int = Field(
        2, ge=1, description="Threads of the gateway's own tokenizer pool (apart from the pool that other work shares)."
    )
    max_tokenizations: int = Field(
        8, ge=1, description="Tokenizations in flight at once (running or waiting for a tokenizer thread) before "
        "RESOURCE_EXHAUSTED; Generate's text prompts and Tokenize both count.",
    )

    # Security
    tls_cert: str = Field(
        "",
        description="PEM certificate chain this server presents, and its clients present to a server that asks "
        "for one (with tls_key; empty = plaintext).",
    )
    tls_key: str = Field("", description="PEM private key of tls_cert.")
    tls_ca: str = Field(
        "", description="PEM CA bundle that the gateway's and the CLI's channels trust (empty = plaintext channels)."
    )
    tls_client_ca: str = Field(
        "",
        description="PEM CA bundle a client certificate must chain to (mutual TLS); empty = no client certificate "
        "asked for.",
    )
    auth_token: str = Field(
        "",
        description="Shared bearer token: servers refuse calls without 'authorization: Bearer <token>' (health "
        "checks exempt) and clients send it; empty = no check. Prefer the DIFFSPEC_AUTH_TOKEN variable to the "
        "flag, which other users can read from ps.",
    )

    api_keys_file: str = Field(
        "",
        description="File of client API keys, one 'TENANT TOKEN' per line ('#' starts a comment): the gateway "
        "takes 'authorization: Bearer TOKEN' as that tenant, which keys its quota and its prefix-cache scope, and "
        "refuses other tokens (UNAUTHENTICATED, HTTP 401); auth_token, when set too, is still accepted. Empty = "
        "no per-tenant keys.",
    )

    @property
    def draft_prefix_cache_capacity(self) -> int:
        """Entries the draft's prefix cache holds: ``draft_prefix_cache_tokens``, or the pool's tokens for -1."""
        if self.draft_prefix_cache_tokens < 0:
            return self.num_pages * self.page_size
        return self.draft_prefix_cache_tokens

    @field_validator("feature_layers")
    @classmethod
    def _check_feature_layers(cls, value: str) -> str:
        if value != "auto":
            parts = [p.strip() for p in value.split(",")]
            if len(parts) != 3 or not all(p.isdigit() for p in parts):
                raise ValueError(f"feature_layers must be 'auto' or three layer indices like '2,16,29', got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_tls(self) -> DiffSpecSettings:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca needs tls_cert and tls_key: mutual TLS is TLS first")
        return self

    @field_validator("graph_batch_sizes", "graph_tree_sizes")
    @classmethod
    def _check_sizes(cls, value: str) -> str:
        parse_sizes(value)
        return value


def parse_sizes(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4): distinct positive sizes, ascending."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"expected comma-separated positive integers like '1,2,4', got {text!r}")
    return tuple(sorted({int(p) for p in parts}))


def resolve_feature_layers(spec: str, num_layers: int) -> tuple[int, int, int]:
    """The three target layers feeding EAGLE-3 (published rule: 2, L//2, L-3 for 8+ layers)."""
    if spec != "auto":
        layers = tuple(int(p) for p in spec.split(","))
    elif num_layers >= 8:
        layers = (2, num_layers // 2, num_layers - 3)
    else:
        layers = (max(1, num_layers // 4), num_layers // 2, num_layers - 1)
    if any(not 0 <= i < num_layers for i in layers):
        raise ValueError(f"feature layers {layers} out of range for a {num_layers}-layer model")
    return layers  # type: ignore[return-value]
