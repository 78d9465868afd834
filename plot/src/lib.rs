//! Figures: the project's one way to draw them, with plotters. The format
//! follows the file name (`.svg` or `.png`). Text is laid out with a font
//! embedded in the binary (a subset of DejaVu Sans: ASCII and a few signs,
//! licence in `assets/fonts/LICENSE`), so a PNG renders the same on a
//! machine with no fonts installed; an SVG names the font and the viewer
//! draws it.

use std::path::Path;
use std::sync::Once;

use anyhow::{Context as _, bail};
use plotters::coord::Shift;
use plotters::prelude::*;

/// The font every figure uses, registered under this family name.
pub const FONT: &str = "sans-serif";

static FONT_BYTES: &[u8] = include_bytes!("../assets/fonts/DejaVuSans-subset.ttf");

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES)
            .map_err(|_| ())
            .expect("the embedded font parses");
    });
}

/// Draws a `size` figure into `path`, SVG or PNG by its extension. Both
/// closures draw the same figure (plotters' backends are distinct types):
/// pass the same generic function twice.
pub fn save(
    path: &Path,
    size: (u32, u32),
    svg: impl FnOnce(DrawingArea<SVGBackend<'_>, Shift>) -> anyhow::Result<()>,
    png: impl FnOnce(DrawingArea<BitMapBackend<'_>, Shift>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    register_font();
    match format(path)? {
        Format::Svg => {
            let mut text = String::new();
            svg(SVGBackend::with_string(&mut text, size).into_drawing_area())?;
            std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
        }
        Format::Png => {
            let mut rgb = vec![0u8; size.0 as usize * size.1 as usize * 3];
            png(BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area())?;
            write_png(path, size, &rgb)
        }
    }
}

/// An image format plots are written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Svg,
    Png,
}

/// The format `path` asks for by its extension, or an error naming it.
pub fn format(path: &Path) -> anyhow::Result<Format> {
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("svg") => Ok(Format::Svg),
        Some(e) if e.eq_ignore_ascii_case("png") => Ok(Format::Png),
        _ => bail!(
            "{}: a plot's file name must end in .svg or .png",
            path.display()
        ),
    }
}

fn write_png(path: &Path, (width, height): (u32, u32), rgb: &[u8]) -> anyhow::Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder
        .write_header()
        .with_context(|| format!("writing {}", path.display()))?;
    writer
        .write_image_data(rgb)
        .with_context(|| format!("writing {}", path.display()))?;
    writer
        .finish()
        .with_context(|| format!("writing {}", path.display()))
}

/// A plotters error as an `anyhow` error (its types are generic over the
/// backend and not always `Send`).
pub fn error(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("drawing the plot: {e}")
}
