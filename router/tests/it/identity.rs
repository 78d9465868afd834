//! An ambiguous identity is refused before anything is forwarded: the
//! tenant header twice or holding a list, `Authorization` twice (see
//! `kvroute_router::tenancy`, rule 4).

use crate::support::*;
use serde_json::json;

#[tokio::test]
async fn a_repeated_or_listed_identity_header_is_400_and_never_forwarded() {
    let (upstream, mut heads) = recording_upstream().await;
    let dir = upstream_dir("ambiguous-identity", upstream);
    std::fs::write(dir.join("keys.yaml"), "k-alice: alice\nk-bob: bob\n").unwrap();
    for keys in [false, true] {
        let mut config = router_config(&dir);
        config.tenancy.tenant_header =
            Some(kvroute_router::config::Header::from_static("x-tenant"));
        if keys {
            config.tenancy.api_keys_file = Some(dir.join("keys.yaml"));
        }
        config.resilience.health_check = None;
        config.proxy.forward_authorization = true;
        config.proxy.forward_tenant_header = true;
        let router = kvroute_router::start(config).await.unwrap();
        let client = reqwest::Client::new();
        let url = format!("http://{}/v1/completions", router.addr());
        let send = |headers: &[(&str, &str)]| {
            let mut request = client.post(&url).json(&json!({"prompt": "hello"}));
            for (name, value) in headers {
                request = request.header(*name, *value);
            }
            request.send()
        };
        let cases: [(&[(&str, &str)], &str); 4] = [
            (
                &[
                    ("authorization", "Bearer k-alice"),
                    ("x-tenant", "alice"),
                    ("x-tenant", "bob"),
                ],
                "the x-tenant header is repeated",
            ),
            (
                &[
                    ("authorization", "Bearer k-alice"),
                    ("x-tenant", "alice, bob"),
                ],
                "the x-tenant header holds a list",
            ),
            (
                &[
                    ("authorization", "Bearer k-alice"),
                    ("authorization", "Bearer k-bob"),
                ],
                "the authorization header is repeated",
            ),
            (
                &[
                    ("authorization", "Bearer k-alice"),
                    ("authorization", "Bearer k-alice"),
                    ("x-tenant", "alice"),
                ],
                "the authorization header is repeated",
            ),
        ];
        for (headers, message) in cases {
            let r = send(headers).await.unwrap();
            assert_eq!(r.status(), 400, "keys {keys}, {headers:?}");
            let body: serde_json::Value = r.json().await.unwrap();
            let error = &body["error"];
            assert!(
                error["message"].as_str().unwrap().starts_with(message),
                "keys {keys}, {headers:?}: {body}"
            );
            assert_eq!(error["type"], "invalid_request_error", "{body}");
        }
        // The model list is behind the same rule.
        let r = client
            .get(format!("http://{}/v1/models", router.addr()))
            .header("x-tenant", "alice")
            .header("x-tenant", "bob")
            .bearer_auth("k-alice")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        // One of each passes, and is the first request the engine sees.
        let r = send(&[
            ("authorization", "Bearer k-alice"),
            ("x-tenant", "alice"),
            ("x-request-marker", "the valid one"),
        ])
        .await
        .unwrap();
        assert_eq!(r.status(), 200, "keys {keys}");
        let head = next_post(&mut heads).await;
        assert_eq!(
            header_of(&head, "x-request-marker").as_deref(),
            Some("the valid one"),
            "nothing refused was forwarded: {head}"
        );
        assert_eq!(
            head.matches("\r\nx-tenant:").count(),
            1,
            "one tenant header reaches the engine: {head}"
        );
        router.shutdown().await;
    }
    while let Ok(head) = heads.try_recv() {
        assert!(!head.starts_with("POST "), "forwarded: {head}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
