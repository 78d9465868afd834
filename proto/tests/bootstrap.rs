//! Checks that the checked-in generated code (`src/gen/kvroute.v1.rs`) is
//! what the `.proto` files produce today.
//!
//! There is no build.rs: building this crate never runs a protobuf compiler.
//! Instead this test regenerates the code with protox (a pure-Rust protobuf
//! compiler) and tonic-prost-build. When the result differs from the
//! checked-in file, it overwrites the file and fails, so the developer
//! re-runs the tests and commits the new code.

use std::path::{Path, PathBuf};

/// The `.proto` files, relative to the crate root (which is also the include
/// directory, so imports read `kvroute/v1/...`).
const PROTOS: &[&str] = &["kvroute/v1/cache.proto", "kvroute/v1/discovery.proto"];

/// The one file prost writes for package `kvroute.v1`.
const GENERATED: &str = "kvroute.v1.rs";

#[test]
fn generated_code_is_fresh() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out_dir = scratch_dir();
    generate(root, &out_dir);

    let fresh = std::fs::read_to_string(out_dir.join(GENERATED)).expect("read generated code");
    let checked_in_path = root.join("src/gen").join(GENERATED);
    let checked_in = std::fs::read_to_string(&checked_in_path).unwrap_or_default();
    if fresh != checked_in {
        std::fs::write(&checked_in_path, &fresh).expect("rewrite generated code");
        panic!(
            "the generated code in {} was stale and has been rewritten; \
             re-run the tests and commit it",
            checked_in_path.display()
        );
    }
}

fn generate(root: &Path, out_dir: &Path) {
    let protos: Vec<PathBuf> = PROTOS.iter().map(|p| root.join(p)).collect();
    let fds = protox::compile(&protos, [root]).expect("compile .proto files");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .out_dir(out_dir)
        .compile_fds(fds)
        .expect("generate Rust code");
}

/// An empty directory of this test's own under Cargo's scratch space.
fn scratch_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvroute-proto-bootstrap");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("clear scratch dir");
    }
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}
