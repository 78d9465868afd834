use kvroute_core::policy::PolicyConfig;

use super::*;

use super::super::trace::req;

#[test]
fn engine_blocks_are_shared_exactly_where_tokens_are() {
    // Trace blocks of 8 tokens, engine blocks of 4.
    let a = engine_hashes(&req(0.0, 24, 1, &[1, 2, 3]), 8, 4, 100);
    let b = engine_hashes(&req(0.0, 20, 1, &[1, 2, 9]), 8, 4, 101);
    let c = engine_hashes(&req(0.0, 24, 1, &[5, 2, 3]), 8, 4, 102);
    assert_eq!((a.len(), b.len()), (6, 5));
    assert_eq!(a[..4], b[..4], "two trace blocks = four engine blocks");
    assert_ne!(a[4], b[4]);
    assert!(
        a.iter().all(|h| !c.contains(h)),
        "a chain: nothing after a difference"
    );
    // Engine blocks straddling trace blocks (6-token blocks over 8).
    let d = engine_hashes(&req(0.0, 24, 1, &[1, 2, 3]), 8, 6, 100);
    let e = engine_hashes(&req(0.0, 24, 1, &[1, 7, 3]), 8, 6, 100);
    assert_eq!(d[0], e[0]);
    assert_ne!(d[1], e[1], "tokens 6..12 reach into the second trace block");
    // Past the trace's ids, tokens are the request's own.
    let f = engine_hashes(&req(0.0, 16, 1, &[1]), 8, 4, 1);
    let g = engine_hashes(&req(0.0, 16, 1, &[1]), 8, 4, 2);
    assert_eq!(f[..2], g[..2]);
    assert_ne!(f[2], g[2]);
}

fn sim(policy: &str, trace: &[TraceRequest], config: model::Config) -> VllmSim {
    let hashes = trace
        .iter()
        .enumerate()
        .map(|(i, r)| engine_hashes(r, 64, config.block_size, i as u64))
        .collect();
    VllmSim::new(
        PolicyConfig::by_name(policy).unwrap().build(),
        1,
        0.0,
        1,
        config,
        Arc::new(hashes),
        trace.iter().map(|r| r.arrival_s),
    )
}

/// The replay runs the model: on one replica, its outcomes are the
/// schedule of the model driven by hand at the same moments.
#[test]
fn the_replay_runs_the_engine_model_on_virtual_time() {
    let config = model::Config {
        block_size: 16,
        num_blocks: 64,
        ..model::Config::default()
    };
    let ids: Vec<u64> = (1..=10).collect();
    let trace = [
        req(0.0, 640, 3, &ids),
        req(0.01, 640, 2, &ids),
        req(0.5, 300, 1, &[20, 21, 22, 23, 24]),
    ];
    let mut s = sim("round-robin", &trace, config.clone());
    for (i, r) in trace.iter().enumerate() {
        s.route(i, r, (RoutingKey(0), None));
    }
    let outcomes: Vec<Outcome> = s.finish().into_iter().map(Option::unwrap).collect();

    let mut engine = model::Engine::new(config);
    let mut first = [None; 3];
    let mut cached = [0; 3];
    let mut now = Duration::ZERO;
    let mut next = 0;
    loop {
        while next < trace.len() && at(trace[next].arrival_s) <= now {
            let r = &trace[next];
            let hashes = engine_hashes(r, 64, 16, next as u64);
            engine
                .add(
                    next as u64,
                    hashes,
                    r.input_length as usize,
                    r.output_length as usize,
                )
                .unwrap();
            next += 1;
        }
        let Some(end) = engine.start_step(now) else {
            match trace.get(next) {
                Some(r) => {
                    now = at(r.arrival_s);
                    continue;
                }
                None => break,
            }
        };
        for (id, p) in engine.take_progress() {
            if let Progress::Admitted { cached_tokens } = p {
                cached[id as usize] = cached_tokens as u64;
            }
        }
        now = end;
        engine.finish_step();
        for (id, p) in engine.take_progress() {
            if let Progress::Token { index: 0, .. } = p {
                first[id as usize] = Some(now);
            }
        }
    }
    for (i, o) in outcomes.iter().enumerate() {
        assert_eq!(o.cached_tokens, cached[i], "request {i}");
        let ttft = first[i].unwrap().as_secs_f64() - trace[i].arrival_s;
        assert!(
            (o.ttft_s - ttft).abs() < 1e-9,
            "request {i}: {} vs {ttft}",
            o.ttft_s
        );
    }
    // The second request found 39 of the first's 40 blocks (the last
    // prompt token is always computed).
    assert_eq!(outcomes[1].cached_tokens, 624);
}

#[test]
fn a_request_that_can_never_fit_is_refused_and_the_rest_served() {
    let config = model::Config {
        block_size: 16,
        num_blocks: 8,
        ..model::Config::default()
    };
    let trace = [req(0.0, 64, 1, &[1]), req(0.1, 200, 1, &[2, 3, 4, 5])];
    let mut s = sim("round-robin", &trace, config);
    for (i, r) in trace.iter().enumerate() {
        s.route(i, r, (RoutingKey(0), None));
    }
    assert_eq!(s.refused(), 1);
    let outcomes = s.finish();
    assert!(outcomes[0].is_some());
    assert!(outcomes[1].is_none());
}
