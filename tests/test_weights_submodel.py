"""A sub-model's weights from a larger checkpoint (issue 30): `weights convert --prefix/--drop` takes a Whisper
encoder's keys from the whole seq2seq checkpoint (a .safetensors file, read key by key), lists the keys it leaves out
with --verbose, and the result loads strictly into transformers' own encoder, which then computes what the encoder
inside the full model computes."""

from __future__ import annotations

from pathlib import Path

from helpers import run_cli

TINY_WHISPER = {"vocab_size": 64, "num_mel_bins": 8, "encoder_layers": 1, "decoder_layers": 1,
                "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32,
                "decoder_ffn_dim": 32, "d_model": 16, "max_source_positions": 10, "max_target_positions": 16,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 3,
                "begin_suppress_tokens": None, "suppress_tokens": None}


def test_an_encoder_taken_from_a_seq2seq_checkpoint_loads_strictly_and_lists_what_was_left_out(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_model
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(0)
    config = WhisperConfig(**TINY_WHISPER)
    full = WhisperForConditionalGeneration(config).eval()
    ckpt = tmp_path / "model.safetensors"
    save_model(full, str(ckpt))  # as the hub stores it (tied weights once)
    keys = set(load_file(str(ckpt)))
    encoder_keys = {k for k in keys if k.startswith("model.encoder.")}
    assert encoder_keys and keys - encoder_keys

    dest = tmp_path / "encoder.safetensors"
    proc = run_cli(["weights", "convert", str(ckpt), str(dest), "--prefix", "model.encoder.", "--verbose"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    left = sorted(keys - encoder_keys)
    assert f"wrote {len(encoder_keys)} tensors" in proc.stdout and f"left out {len(left)} key(s)" in proc.stdout
    listed = [line.split("left out: ", 1)[1] for line in proc.stdout.splitlines() if "  left out: " in line]
    assert listed == left and any(k.startswith("model.decoder.") for k in listed)

    encoder = WhisperEncoder(config).eval()
    encoder.load_state_dict(load_file(str(dest)), strict=True)  # every key, every shape, nothing extra
    features = torch.randn(2, config.num_mel_bins, 2 * config.max_source_positions)
    with torch.no_grad():
        want = full.model.encoder(features).last_hidden_state
        got = encoder(features).last_hidden_state
    assert torch.equal(got, want)

    # --drop leaves out other parts' keys, keeping the rest as they are; a prefix that matches nothing (proj_out is
    # tied to the decoder's embedding, stored once under the latter's name) is refused, nothing written
    proc = run_cli(["weights", "convert", str(ckpt), str(tmp_path / "no_decoder.safetensors"),
                    "--drop", "model.decoder."], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert set(load_file(str(tmp_path / "no_decoder.safetensors"))) == {k for k in keys
                                                                         if not k.startswith("model.decoder.")}
    bad = run_cli(["weights", "convert", str(ckpt), str(tmp_path / "x.safetensors"), "--drop", "model.decoder.",
                   "--drop", "proj_out."], tmp_path)
    assert bad.returncode == 2 and "--drop 'proj_out.' matches no key" in bad.stderr and bad.stderr.count("\n") == 1
    assert not (tmp_path / "x.safetensors").exists()
