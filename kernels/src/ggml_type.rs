use crate::KernelError;

/// Tensor element types as GGML numbers them in GGUF files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    BF16,
}

impl GgmlType {
    /// Maps a GGUF type id; ids we do not implement are an error, not a panic.
    pub fn from_id(id: u32) -> Result<Self, KernelError> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            30 => Self::BF16,
            other => return Err(Self::unsupported_id(other)),
        })
    }

    fn unsupported_id(id: u32) -> KernelError {
        // Name the known-but-unimplemented types so the user learns what the file holds.
        let name = match id {
            10 => "Q2_K",
            11 => "Q3_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => return KernelError::UnknownTypeId(id),
        };
        KernelError::UnsupportedType(format!("{name} (type id {id})"))
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q8_1 => 9,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Q8K => 15,
            Self::BF16 => 30,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q8_1 => "Q8_1",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Q8K => "Q8_K",
            Self::BF16 => "BF16",
        }
    }

    /// Values per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::Q8_1 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K | Self::Q8K => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use crate::blocks::*;
        use std::mem::size_of;
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => size_of::<BlockQ4_0>(),
            Self::Q4_1 => size_of::<BlockQ4_1>(),
            Self::Q5_0 => size_of::<BlockQ5_0>(),
            Self::Q5_1 => size_of::<BlockQ5_1>(),
            Self::Q8_0 => size_of::<BlockQ8_0>(),
            Self::Q8_1 => size_of::<BlockQ8_1>(),
            Self::Q4K => size_of::<BlockQ4K>(),
            Self::Q5K => size_of::<BlockQ5K>(),
            Self::Q6K => size_of::<BlockQ6K>(),
            Self::Q8K => size_of::<BlockQ8K>(),
        }
    }

    /// Bytes of one row of `cols` values; errors when `cols` splits a block.
    pub fn row_bytes(self, cols: usize) -> Result<usize, KernelError> {
        let block = self.block_size();
        if !cols.is_multiple_of(block) {
            return Err(KernelError::RaggedRow { ty: self, cols, block });
        }
        Ok(cols / block * self.type_size())
    }

    /// The type activations are converted to before a dot product with a
    /// weight row of this type (as GGML's CPU backend does, so results match).
    pub fn vec_dot_type(self) -> GgmlType {
        match self {
            Self::F32 => Self::F32,
            Self::F16 => Self::F16,
            Self::BF16 => Self::BF16,
            Self::Q4_0 | Self::Q5_0 | Self::Q8_0 => Self::Q8_0,
            Self::Q4_1 | Self::Q5_1 => Self::Q8_1,
            Self::Q8_1 => Self::Q8_1,
            Self::Q4K | Self::Q5K | Self::Q6K | Self::Q8K => Self::Q8K,
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
