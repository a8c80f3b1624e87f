// notebook cell
/// The policies measured, with their names in tables and metrics.
pub fn policy_list() -> [(&'static str, &'static str, Option<Policy>); 4] {
    [
        ("plain backprop", "plain", None),
        (
            "keep nothing (nothing_saveable)",
            "nothing",
            Some(Policy::Nothing),
        ),
        (
            "keep every product (dots_saveable)",
            "dots",
            Some(Policy::Dots),
        ),
        (
            "keep the linear layers' products",
            "names",
            Some(Policy::Names(
                ["qkv", "proj", "up", "down"].map(String::from).to_vec(),
            )),
        ),
    ]
}

/// The transformer the policies train, seeded, with the map that holds
/// its parameters, and a batch of tokens and targets, tagged by role.
pub fn policy_model(
    ctx: &Context,
    p: &CheckpointingParams,
) -> anyhow::Result<(Transformer, VarMap, Tensor, Tensor)> {
    let device = ctx.device().clone();
    let cfg = TransformerConfig {
        vocab: 256,
        width: p.policy_width,
        heads: p.policy_heads,
        depth: p.policy_depth,
        tiled: None,
    };
    let map = VarMap::new();
    let model = Category::Parameters.scope(|| Transformer::seeded(&cfg, p.seed, &map, &device))?;
    let (ids, targets) = Category::Inputs
        .scope(|| batch(p.seed, p.policy_batch, p.policy_seq, cfg.vocab, &device))?;
    Ok((model, map, ids, targets))
}

/// Selective checkpointing on a small transformer, one block per
/// segment: what each policy keeps, its peak and its time.
pub fn policies(ctx: &mut Context, p: &CheckpointingParams) -> anyhow::Result<()> {
    let (model, map, ids, targets) = policy_model(ctx, p)?;
    let vars = map.all_vars();
    let head = |h: &Tensor| model.loss(h, &targets);
    let segments = model.layers().len();
    let mut table = Table::new(
        format!(
            "Selective checkpointing, {} blocks of width {}, {} heads, {} x {} tokens, a segment per block",
            p.policy_depth, p.policy_width, p.policy_heads, p.policy_batch, p.policy_seq
        ),
        &[
            ("policy", Unit::None),
            ("peak", Unit::Bytes),
            ("activations at their peak", Unit::Bytes),
            ("median time", Unit::Seconds),
            ("max |grad diff|", Unit::None),
        ],
    );
    let mut reference: Option<GradStore> = None;
    let mut worst = 0f64;
    for (label, key, policy) in policy_list() {
        let mut times = Vec::new();
        let mut report = None;
        for rep in 0..p.repeats {
            ctx.progress(&format!("policy {key}, run {}", rep + 1));
            let mut region = ctx.region(format!("policy: {label}"));
            let start = Instant::now();
            let grads = match &policy {
                None => Category::Gradients.scope(|| -> anyhow::Result<GradStore> {
                    let loss = Category::Activations
                        .scope(|| head(&run_segment(model.layers(), &ids)?))?;
                    region.mark("after forward");
                    Ok(param_grads(&loss.backward()?, &vars))
                })?,
                Some(policy) => {
                    Sequential::taped(model.layers())
                        .segments(segments)
                        .policy(policy)
                        .observer(&Marks::new(&mut region))
                        .backward(&ids, &vars, head)?
                        .grads
                }
            };
            region.mark("after backward");
            times.push(start.elapsed().as_secs_f64());
            if rep == 0 {
                let diff = match &reference {
                    Some(r) => grads_max_abs_diff(r, &grads, &vars)?,
                    None => 0.0,
                };
                worst = worst.max(diff);
                if reference.is_none() {
                    reference = Some(grads);
                } else {
                    drop(grads);
                }
                report = Some((ctx.end_region(region), diff));
            }
        }
        let Some((r, diff)) = report else {
            anyhow::bail!("no run of policy {key}");
        };
        let time = median(times);
        let peak = r.peak_above_baseline();
        let acts = r.category_peak_above_baseline(Category::Activations);
        ctx.metric(format!("policy_peak_{key}"), peak as f64);
        ctx.metric(format!("policy_activations_{key}"), acts as f64);
        ctx.metric(format!("policy_time_{key}"), time);
        table.row(vec![
            label.into(),
            peak.into(),
            acts.into(),
            time.into(),
            diff.into(),
        ]);
    }
    ctx.metric("policy_grad_max_abs_diff", worst);
    ctx.table(table);
    Ok(())
}
