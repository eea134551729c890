//! An incremental reader of a `text/event-stream` that hands back each event's raw bytes (to
//! forward them unchanged) together with its `data` (to look for the response to a call).
//!
//! Events are split as the HTML standard says: lines end at CRLF, LF or CR; a blank line ends
//! an event; `data:` lines are joined with LF; a line starting with `:` is a comment. A block
//! that carries no data (a comment, a keep-alive, a priming event) is still handed back, with
//! its bytes, so that nothing is held back or dropped.

use bytes::{Bytes, BytesMut};

/// One event, as it was on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// Every byte of the event, its terminating blank line included.
    pub raw: Bytes,
    /// The joined `data` lines, if it had any.
    pub data: Option<Vec<u8>>,
}

impl Block {
    /// The event with its data replaced by `data`: its other fields (`id`, `event`, `retry`)
    /// kept, one `data` line per line of `data`, ended by a blank line.
    pub fn with_data(&self, data: &[u8]) -> Bytes {
        let mut out = Vec::with_capacity(self.raw.len() + data.len());
        let text = String::from_utf8_lossy(&self.raw);
        for line in text.split(['\r', '\n']).filter(|l| !l.is_empty()) {
            if line != "data" && !line.starts_with("data:") {
                out.extend_from_slice(line.as_bytes());
                out.push(b'\n');
            }
        }
        for line in data.split(|b| *b == b'\n') {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(line.strip_suffix(b"\r").unwrap_or(line));
            out.push(b'\n');
        }
        out.push(b'\n');
        Bytes::from(out)
    }
}

/// The reader. Feed it chunks as they arrive; it hands back the events completed so far.
#[derive(Debug)]
pub struct SseReader {
    /// Bytes of the event being read (whole lines and a partial one).
    pending: BytesMut,
    /// How far `pending` has been split into lines.
    scanned: usize,
    /// The data lines of the event being read.
    data: Option<Vec<u8>>,
    /// Largest event held whole; a longer one is handed back in pieces, without data.
    max_event: usize,
    /// Whether an event was longer than `max_event`.
    overflowed: bool,
}

impl SseReader {
    /// A reader holding events of at most `max_event` bytes whole.
    pub fn new(max_event: usize) -> Self {
        Self { pending: BytesMut::new(), scanned: 0, data: None, max_event, overflowed: false }
    }

    /// Whether an event was too long to be read (its data was not looked at).
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Adds a chunk; answers the events it completed, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Block> {
        self.pending.extend_from_slice(chunk);
        let mut blocks = Vec::new();
        while let Some((line_end, next)) = self.next_line() {
            let line = self.pending[self.scanned..line_end].to_vec();
            self.scanned = next;
            if line.is_empty() {
                let raw = self.pending.split_to(self.scanned).freeze();
                self.scanned = 0;
                blocks.push(Block { raw, data: self.data.take() });
            } else {
                self.field(&line);
            }
        }
        if self.pending.len() > self.max_event {
            // Too long to hold: hand the bytes on as they are, and stop reading this event.
            self.overflowed = true;
            let raw = self.pending.split().freeze();
            self.scanned = 0;
            self.data = None;
            blocks.push(Block { raw, data: None });
        }
        blocks
    }

    /// The bytes of an unfinished event at the end of the stream (to forward as they are).
    pub fn finish(&mut self) -> Option<Bytes> {
        self.data = None;
        self.scanned = 0;
        (!self.pending.is_empty()).then(|| self.pending.split().freeze())
    }

    /// The end of the next whole line after `scanned` and where the line after it starts; a CR
    /// at the very end waits for the next chunk (it may be the first half of a CRLF).
    fn next_line(&self) -> Option<(usize, usize)> {
        let rest = &self.pending[self.scanned..];
        let at = rest.iter().position(|&b| b == b'\n' || b == b'\r')?;
        let end = self.scanned + at;
        match rest[at] {
            b'\n' => Some((end, end + 1)),
            _ => match rest.get(at + 1) {
                Some(b'\n') => Some((end, end + 2)),
                Some(_) => Some((end, end + 1)),
                None => None,
            },
        }
    }

    fn field(&mut self, line: &[u8]) {
        if line.first() == Some(&b':') {
            return;
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &[][..]),
        };
        if name == b"data" {
            let data = self.data.get_or_insert_with(Vec::new);
            if !data.is_empty() {
                data.push(b'\n');
            }
            data.extend_from_slice(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(reader: &mut SseReader, chunks: &[&[u8]]) -> Vec<Block> {
        chunks.iter().flat_map(|c| reader.push(c)).collect()
    }

    #[test]
    fn events_come_back_with_their_bytes_and_data() {
        let stream: &[u8] = b"event: message\r\nid: 1\r\ndata: {\"a\":1}\r\n\r\n: ping\n\ndata: x\ndata: y\n\n";
        let mut reader = SseReader::new(1024);
        let blocks = reader.push(stream);
        assert_eq!(blocks.len(), 3);
        assert_eq!(&blocks[0].raw[..], b"event: message\r\nid: 1\r\ndata: {\"a\":1}\r\n\r\n");
        assert_eq!(blocks[0].data.as_deref(), Some(&b"{\"a\":1}"[..]));
        assert_eq!(blocks[1].data, None);
        assert_eq!(blocks[2].data.as_deref(), Some(&b"x\ny"[..]));
        let joined: Vec<u8> = blocks.iter().flat_map(|b| b.raw.to_vec()).collect();
        assert_eq!(joined, stream, "nothing is lost or changed");
        assert_eq!(reader.finish(), None);
    }

    #[test]
    fn any_split_of_the_stream_gives_the_same_events() {
        let stream: &[u8] = b"data:{\"id\":1}\r\n\r\ndata: two\r\rdata: three\n\n";
        let whole = SseReader::new(1024).push(stream);
        assert_eq!(whole.len(), 3);
        assert_eq!(whole[1].data.as_deref(), Some(&b"two"[..]));
        for cut in 0..stream.len() {
            for cut2 in cut..stream.len() {
                let mut reader = SseReader::new(1024);
                let blocks = all(&mut reader, &[&stream[..cut], &stream[cut..cut2], &stream[cut2..]]);
                assert_eq!(blocks, whole, "cut at {cut} and {cut2}");
            }
        }
    }

    #[test]
    fn an_unfinished_event_is_handed_back_at_the_end() {
        let mut reader = SseReader::new(1024);
        assert!(reader.push(b"data: half").is_empty());
        assert_eq!(reader.finish().as_deref(), Some(&b"data: half"[..]));
    }

    #[test]
    fn an_event_over_the_limit_passes_without_data() {
        let mut reader = SseReader::new(8);
        let blocks = reader.push(b"data: 0123456789");
        assert!(reader.overflowed());
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0].data, None);
        assert_eq!(&blocks[0].raw[..], b"data: 0123456789");
    }

    #[test]
    fn an_event_gets_new_data_and_keeps_its_other_fields() {
        let mut reader = SseReader::new(1024);
        let block = reader.push(b"id: 7\r\nevent: message\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\n").remove(0);
        let rewritten = block.with_data(b"{\"b\":\n2}");
        assert_eq!(&rewritten[..], b"id: 7\nevent: message\ndata: {\"b\":\ndata: 2}\n\n");
        let again = SseReader::new(1024).push(&rewritten).remove(0);
        assert_eq!(again.data.as_deref(), Some(&b"{\"b\":\n2}"[..]));
    }
}
