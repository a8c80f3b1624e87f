//! Quoting user input in messages: at most a short excerpt of it, so a
//! megabyte of chapter text is never echoed back whole.

/// How many characters of an input a message quotes.
pub const QUOTE: usize = 120;

/// At most `max` characters of `s`, marked with its full length when cut.
pub fn excerpt(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}... ({} bytes in all)", &s[..i], s.len()),
        None => s.to_string(),
    }
}

/// [`excerpt`] at the length messages quote.
pub fn quote(s: &str) -> String {
    excerpt(s, QUOTE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_inputs_are_whole_and_long_ones_are_cut_with_their_length() {
        assert_eq!(quote("a > "), "a > ");
        let long = "x".repeat(1_000_000);
        let q = quote(&long);
        assert_eq!(
            q,
            format!("{}... (1000000 bytes in all)", "x".repeat(QUOTE))
        );
        // Never inside a character.
        assert_eq!(excerpt("ééé", 2), "éé... (6 bytes in all)");
    }
}
