//! Text from chapters and plugins on its way to a terminal: control
//! characters are shown escaped, so that a title or a printed line cannot
//! set the window's title, clear the screen or move the cursor.

use std::borrow::Cow;

/// Whether `c` is a control character a terminal would act on: C0 controls
/// other than newline and tab, DEL, and the C1 controls (U+0080-U+009F,
/// which include a one-character CSI).
fn is_control(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t') || ('\u{80}'..='\u{9f}').contains(&c)
}

/// `text` with every control character a terminal would act on written as
/// a visible escape (`\x1b`, `\r`, `\u{9b}`); newlines and tabs stay.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if !is_control(c) {
            out.push(c);
        } else if c == '\r' {
            out.push_str("\\r");
        } else if (c as u32) < 0x80 {
            out.push_str(&format!("\\x{:02x}", c as u32));
        } else {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn escape_sequences_are_shown_not_obeyed() {
        assert!(matches!(
            printable("plain, with a tab\tand\nlines"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(
            printable("\u{1b}]0;owned\u{7}title\u{1b}[2J\r\u{7f}\u{9b}31m"),
            "\\x1b]0;owned\\x07title\\x1b[2J\\r\\x7f\\u{9b}31m"
        );
        assert_eq!(printable("é ✓ 世界"), "é ✓ 世界");
    }
}
