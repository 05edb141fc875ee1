"""What `raylm sweep` prints: a line as it goes, and its summary at the end."""

from __future__ import annotations

from raylm.sweep.results import RECOMMENDED_FILE


def say(line: str) -> None:
    print(f"raylm: {line}", flush=True)


def summary(result: dict) -> str:
    """What `raylm sweep` prints at the end."""
    asha = result["asha"]
    took = f", {result['wall_s'] / 60:.1f} min" if result.get("wall_s") is not None else ""
    lines = [f"sweep {result['sweep']}: {asha['trials']} ladder trials, {asha['stopped_early']} stopped early by ASHA "
             f"({100 * asha['saved_fraction']:.0f}% of the planned compute saved){took}"]
    p = result.get("parametric", {})
    if "E" in p:
        lines.append(f"fit: L(N, D) = {p['E']:.3f} + {p['A']:.3g}/N^{p['alpha']:.3f} + {p['B']:.3g}/D^{p['beta']:.3f}")
    else:
        lines.append(f"fit: none ({p.get('error')})")
    law = result["lr"].get("lr_vs_params", {})
    transfer = result.get("transfer")
    if transfer:
        tried = [f"{m['output_multiplier']:g}" for m in transfer.get("multipliers", [])]  # none: an earlier raylm's
        found = f"lr {transfer['lr']:.4g}"
        if len(tried) > 1:
            found += f" and output multiplier {transfer['output_multiplier']:g} (of {', '.join(tried)})"
        lines.append(f"µP: {found} found at the base width {transfer['base_width']} "
                     f"({transfer['asha']['trials']} trials), every size trained at {'them' if len(tried) > 1 else 'it'}")
    elif "coef" in law:
        lines.append(f"best lr: {law['coef']:.3g} * N^{law['exponent']:.3f}")
    chosen = result.get("predictor")
    if chosen:
        lines.append(f"predictor: {chosen['chosen']} ({chosen['why']})")
    noise = result.get("noise")
    if noise:
        losses = ", ".join(f"{x:.4f}" for x in noise["losses"])
        lines.append(f"noise floor: {100 * noise['relative_spread']:.2f}% (losses {losses} "
                     f"of {noise['rung']} with seeds {noise['seeds']})")
    check = result.get("check")
    if check and check.get("measured_loss") is not None:
        others = ", ".join(f"{k} {100 * v:+.2f}%" for k, v in check["errors_by_predictor"].items())
        lines.append(f"check: {check['params']:,} parameters, {check['tokens']:,} tokens: "
                     f"predicted {check['predicted_loss']:.4f} "
                     f"[{check['interval'][0]:.4f}, {check['interval'][1]:.4f}], measured {check['measured_loss']:.4f} "
                     f"({100 * check['relative_error']:+.2f}%; by predictor: {others})")
    averaged = (check or {}).get("averaged")
    if averaged and "relative_error" in averaged:
        shapes = "; ".join(f"{e['rung']} {e['params']:,} params {e['measured_loss']:.4f} over {len(e['losses'])} "
                           f"seed(s) ({100 * e['relative_error']:+.2f}%)" for e in averaged["shapes"] if e["losses"])
        others = ", ".join(f"{k} {100 * v:+.2f}%" for k, v in averaged["errors_by_predictor"].items())
        lines.append(f"check over {averaged['measured_shapes']} shape(s) and their seeds: mean error "
                     f"{100 * averaged['relative_error']:+.2f}% (by predictor: {others}; {shapes})")
    for knob, shown in (("lr", ".3g"), ("batch", "g")):
        pick = (check or {}).get(f"{knob}_pick")
        if pick:
            lines.append(f"{knob} pick: {pick[f'picked_{knob}']:{shown}} -> {pick['picked_loss']:.4f}; best of the "
                         f"{len(pick['tried'])} {pick[f'best_{knob}']:{shown}} -> {pick['best_loss']:.4f} "
                         f"({100 * pick['relative_gap']:+.2f}%"
                         + ("" if pick["good"] is None else f", {'within' if pick['good'] else 'beyond'} the noise floor")
                         + ")")
    rec = result.get("recommended")
    if rec and "error" not in rec:
        # A refit keeps the sweep's recommendation: say so, or its loss reads as the refit's prediction.
        lines.append(f"recommended: {rec['params']:,} parameters, {rec['tokens']:,} tokens, lr {rec['lr']:.3g}, "
                     f"predicted loss {rec['predicted_loss']['loss']:.4f} -> {result['sweep']}/{RECOMMENDED_FILE}"
                     + (f" ({rec['refit']})" if "refit" in rec else ""))
    lines += [f"warning: {w}" for w in result.get("warnings", [])]
    return "\n".join(lines)
