//! A small RGB raster for plots: rectangles, lines (solid or dashed, with a thickness),
//! text in the built-in bitmap font (horizontal or turned a quarter left), and PNG
//! encoding with the `png` crate. Pure Rust: no system libraries, no font files.
//! Coordinates are pixels from the top-left corner; whatever falls outside is clipped.

use super::font::{glyph, ADVANCE, GLYPH_HEIGHT, GLYPH_WIDTH};

pub type Rgb = [u8; 3];

pub const WHITE: Rgb = [255, 255, 255];
pub const BLACK: Rgb = [0, 0, 0];

pub struct Canvas {
    width: usize,
    height: usize,
    /// Row-major RGB, three bytes per pixel: what the PNG encoder takes.
    pixels: Vec<u8>,
}

impl Canvas {
    pub fn new(width: usize, height: usize, background: Rgb) -> Self {
        let mut pixels = Vec::with_capacity(width * height * 3);
        for _ in 0..width * height {
            pixels.extend_from_slice(&background);
        }
        Self {
            width,
            height,
            pixels,
        }
    }

    pub fn set(&mut self, x: i64, y: i64, color: Rgb) {
        if x < 0 || y < 0 || x >= self.width as i64 || y >= self.height as i64 {
            return;
        }
        let at = (y as usize * self.width + x as usize) * 3;
        self.pixels[at..at + 3].copy_from_slice(&color);
    }

    pub fn fill_rect(&mut self, x: i64, y: i64, w: i64, h: i64, color: Rgb) {
        for yy in y.max(0)..(y + h).min(self.height as i64) {
            for xx in x.max(0)..(x + w).min(self.width as i64) {
                self.set(xx, yy, color);
            }
        }
    }

    /// The outline of a rectangle, one pixel wide, inside (x, y, w, h).
    pub fn stroke_rect(&mut self, x: i64, y: i64, w: i64, h: i64, color: Rgb) {
        self.fill_rect(x, y, w, 1, color);
        self.fill_rect(x, y + h - 1, w, 1, color);
        self.fill_rect(x, y, 1, h, color);
        self.fill_rect(x + w - 1, y, 1, h, color);
    }

    /// A straight line `thickness` pixels wide (a square brush along Bresenham's path).
    pub fn line(&mut self, from: (i64, i64), to: (i64, i64), color: Rgb, thickness: i64) {
        self.dashed_line(from, to, color, thickness, None);
    }

    /// A line drawn `dash.0` pixels on, `dash.1` off (counted along the longer axis);
    /// `None`: solid.
    pub fn dashed_line(
        &mut self,
        (x0, y0): (i64, i64),
        (x1, y1): (i64, i64),
        color: Rgb,
        thickness: i64,
        dash: Option<(i64, i64)>,
    ) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = ((x1 - x0).signum(), (y1 - y0).signum());
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        let before = (thickness - 1) / 2;
        let mut step = 0i64;
        loop {
            let on = dash.is_none_or(|(on, off)| step % (on + off) < on);
            if on {
                self.fill_rect(x - before, y - before, thickness, thickness, color);
            }
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
            step += 1;
        }
    }

    /// Width in pixels of `text` at `scale` (font pixels are `scale` x `scale` squares).
    pub fn text_width(text: &str, scale: usize) -> i64 {
        let chars = text.chars().count();
        if chars == 0 {
            return 0;
        }
        ((chars * ADVANCE - 1) * scale) as i64
    }

    /// Height in pixels of one line of text at `scale`.
    pub fn text_height(scale: usize) -> i64 {
        (GLYPH_HEIGHT * scale) as i64
    }

    /// Draws `text` with its top-left corner at (x, y).
    pub fn text(&mut self, x: i64, y: i64, text: &str, color: Rgb, scale: usize) {
        self.glyphs(text, scale, |dx, dy| (x + dx, y + dy), color);
    }

    /// Draws `text` turned a quarter left (reading bottom to top), its first character's
    /// bottom-left corner at (x, y): a y-axis title.
    pub fn text_up(&mut self, x: i64, y: i64, text: &str, color: Rgb, scale: usize) {
        self.glyphs(text, scale, |dx, dy| (x + dy, y - dx), color);
    }

    /// Plots every inked font pixel of `text`, mapped from (dx, dy) in the unturned text
    /// to the canvas by `place`.
    fn glyphs(
        &mut self,
        text: &str,
        scale: usize,
        place: impl Fn(i64, i64) -> (i64, i64),
        color: Rgb,
    ) {
        let s = scale as i64;
        for (i, c) in text.chars().enumerate() {
            let left = (i * ADVANCE) as i64 * s;
            for (col, bits) in glyph(c).iter().enumerate().take(GLYPH_WIDTH) {
                for row in 0..GLYPH_HEIGHT {
                    if bits & (1 << row) == 0 {
                        continue;
                    }
                    for py in 0..s {
                        for px in 0..s {
                            let (cx, cy) = place(left + col as i64 * s + px, row as i64 * s + py);
                            self.set(cx, cy, color);
                        }
                    }
                }
            }
        }
    }

    /// The image as a PNG file.
    pub fn to_png(&self) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, self.width as u32, self.height as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        encoder.set_compression(png::Compression::Best);
        let mut writer = encoder
            .write_header()
            .map_err(|e| format!("cannot encode the PNG: {e}"))?;
        writer
            .write_image_data(&self.pixels)
            .map_err(|e| format!("cannot encode the PNG: {e}"))?;
        writer
            .finish()
            .map_err(|e| format!("cannot encode the PNG: {e}"))?;
        Ok(out)
    }
}

#[cfg(test)]
impl Canvas {
    pub fn pixel(&self, x: usize, y: usize) -> Rgb {
        let at = (y * self.width + x) * 3;
        [self.pixels[at], self.pixels[at + 1], self.pixels[at + 2]]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inked(c: &Canvas) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for y in 0..c.height {
            for x in 0..c.width {
                if c.pixel(x, y) != WHITE {
                    out.push((x, y));
                }
            }
        }
        out
    }

    #[test]
    fn a_line_covers_both_ends_and_a_dashed_one_has_gaps() {
        let mut c = Canvas::new(40, 40, WHITE);
        c.line((2, 3), (30, 20), BLACK, 1);
        assert_eq!(c.pixel(2, 3), BLACK);
        assert_eq!(c.pixel(30, 20), BLACK);
        let mut dashed = Canvas::new(40, 5, WHITE);
        dashed.dashed_line((0, 2), (39, 2), BLACK, 1, Some((4, 4)));
        assert_eq!(inked(&dashed).len(), 20, "half of 40 pixels");
        assert_eq!(dashed.pixel(0, 2), BLACK);
        assert_eq!(dashed.pixel(4, 2), WHITE);
    }

    #[test]
    fn text_stays_in_its_box_and_turned_text_in_the_turned_box() {
        let mut c = Canvas::new(100, 100, WHITE);
        c.text(10, 20, "Ag5", BLACK, 2);
        let (w, h) = (Canvas::text_width("Ag5", 2), Canvas::text_height(2));
        let ink = inked(&c);
        assert!(!ink.is_empty());
        assert!(ink.iter().all(|&(x, y)| {
            (10..10 + w).contains(&(x as i64)) && (20..20 + h).contains(&(y as i64))
        }));
        let mut up = Canvas::new(100, 100, WHITE);
        up.text_up(10, 90, "Ag5", BLACK, 2);
        let ink = inked(&up);
        assert!(ink.iter().all(|&(x, y)| {
            (10..10 + h).contains(&(x as i64)) && (90 - w + 1..=90).contains(&(y as i64))
        }));
    }

    #[test]
    fn drawing_outside_the_canvas_is_clipped() {
        let mut c = Canvas::new(10, 10, WHITE);
        c.fill_rect(-5, -5, 8, 8, BLACK);
        c.line((-20, 5), (50, 5), BLACK, 3);
        c.text(8, 8, "WWW", BLACK, 3);
        assert_eq!(c.pixel(0, 0), BLACK);
        assert_eq!(c.pixel(9, 5), BLACK);
    }
}
