//! A deserializer that reads every struct only from a JSON object. serde's derived structs
//! also take an array, filling the fields by position (`{"quotas": [null, null]}` made an
//! empty quota set, `{"lifecycle": [null, null]}` a default lifecycle): a client's mistake,
//! or a hostile body, that was accepted and meant something else. [`Objects`] wraps a
//! deserializer, at every depth, so that a struct asks for a map, which an array is not.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess};
use serde::de::{VariantAccess, Visitor};

/// `D`, with structs read only from objects (at every depth).
pub struct Objects<D>(pub D);

/// `serde_json::from_slice`, with structs read only from objects.
pub fn from_slice<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> serde_json::Result<T> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = T::deserialize(Objects(&mut deserializer))?;
    deserializer.end()?;
    Ok(value)
}

/// `serde_json::from_str`, with structs read only from objects.
pub fn from_str<'a, T: serde::Deserialize<'a>>(text: &'a str) -> serde_json::Result<T> {
    from_slice(text.as_bytes())
}

/// `serde_json::from_value`, with structs read only from objects.
pub fn from_value<T: serde::de::DeserializeOwned>(
    value: serde_json::Value,
) -> serde_json::Result<T> {
    T::deserialize(Objects(value))
}

/// A visitor, seed or access whose inner deserializers are wrapped in [`Objects`].
struct Wrap<T>(T);

macro_rules! forward {
    ($($method:ident),* $(,)?) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
                self.0.$method(Wrap(visitor))
            }
        )*
    };
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Objects<D> {
    type Error = D::Error;

    forward!(
        deserialize_any,
        deserialize_bool,
        deserialize_i8,
        deserialize_i16,
        deserialize_i32,
        deserialize_i64,
        deserialize_i128,
        deserialize_u8,
        deserialize_u16,
        deserialize_u32,
        deserialize_u64,
        deserialize_u128,
        deserialize_f32,
        deserialize_f64,
        deserialize_char,
        deserialize_str,
        deserialize_string,
        deserialize_bytes,
        deserialize_byte_buf,
        deserialize_option,
        deserialize_unit,
        deserialize_seq,
        deserialize_map,
        deserialize_identifier,
        deserialize_ignored_any,
    );

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_unit_struct(name, Wrap(visitor))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_newtype_struct(name, Wrap(visitor))
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple(len, Wrap(visitor))
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple_struct(name, len, Wrap(visitor))
    }

    /// The point of it all: a struct is read as a map, so an array is refused ("invalid
    /// type: sequence, expected struct …").
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_map(Wrap(visitor))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_enum(name, variants, Wrap(visitor))
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

macro_rules! visit {
    ($($method:ident($ty:ty)),* $(,)?) => {
        $(
            fn $method<E: de::Error>(self, v: $ty) -> Result<V::Value, E> {
                self.0.$method(v)
            }
        )*
    };
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrap<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.expecting(f)
    }

    visit!(
        visit_bool(bool),
        visit_i8(i8),
        visit_i16(i16),
        visit_i32(i32),
        visit_i64(i64),
        visit_i128(i128),
        visit_u8(u8),
        visit_u16(u16),
        visit_u32(u32),
        visit_u64(u64),
        visit_u128(u128),
        visit_f32(f32),
        visit_f64(f64),
        visit_char(char),
        visit_str(&str),
        visit_borrowed_str(&'de str),
        visit_string(String),
        visit_bytes(&[u8]),
        visit_borrowed_bytes(&'de [u8]),
        visit_byte_buf(Vec<u8>),
    );

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.0.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.0.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        self.0.visit_some(Objects(deserializer))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<V::Value, D::Error> {
        self.0.visit_newtype_struct(Objects(deserializer))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        self.0.visit_seq(Wrap(seq))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.0.visit_map(Wrap(map))
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        self.0.visit_enum(Wrap(data))
    }
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Wrap<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<S::Value, D::Error> {
        self.0.deserialize(Objects(deserializer))
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Wrap<A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, A::Error> {
        self.0.next_element_seed(Wrap(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Wrap<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        self.0.next_key_seed(Wrap(seed))
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        self.0.next_value_seed(Wrap(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: EnumAccess<'de>> EnumAccess<'de> for Wrap<A> {
    type Error = A::Error;
    type Variant = Wrap<A::Variant>;

    fn variant_seed<S: DeserializeSeed<'de>>(
        self,
        seed: S,
    ) -> Result<(S::Value, Wrap<A::Variant>), A::Error> {
        let (value, variant) = self.0.variant_seed(Wrap(seed))?;
        Ok((value, Wrap(variant)))
    }
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for Wrap<A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.0.unit_variant()
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, A::Error> {
        self.0.newtype_variant_seed(Wrap(seed))
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        self.0.tuple_variant(len, Wrap(visitor))
    }

    /// A struct variant is a struct too: its fields come from an object only (its value is
    /// read as a newtype's, as a map).
    fn struct_variant<V: Visitor<'de>>(
        self,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        self.0.newtype_variant_seed(AsMap(visitor))
    }
}

/// Reads a struct variant's fields as a map.
struct AsMap<V>(V);

impl<'de, V: Visitor<'de>> DeserializeSeed<'de> for AsMap<V> {
    type Value = V::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        Objects(deserializer).deserialize_map(Wrap(self.0))
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::Objects;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        a: Option<u32>,
        b: Option<u32>,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        inner: Option<Inner>,
        list: Option<Vec<Inner>>,
        pair: Option<(u32, u32)>,
        #[serde(default)]
        tagged: Option<Tagged>,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(rename_all = "lowercase")]
    enum Tagged {
        Plain,
        Shape { w: u32 },
    }

    fn read(text: &str) -> Result<Outer, String> {
        let mut de = serde_json::Deserializer::from_str(text);
        Outer::deserialize(Objects(&mut de)).map_err(|e| e.to_string())
    }

    #[test]
    fn structs_come_from_objects_only_at_every_depth() {
        let whole = r#"{"inner": {"a": 1}, "list": [{"b": 2}], "pair": [3, 4], "tagged": {"shape": {"w": 5}}}"#;
        assert_eq!(
            read(whole).unwrap(),
            Outer {
                inner: Some(Inner {
                    a: Some(1),
                    b: None
                }),
                list: Some(vec![Inner {
                    a: None,
                    b: Some(2)
                }]),
                pair: Some((3, 4)),
                tagged: Some(Tagged::Shape { w: 5 }),
            }
        );
        assert_eq!(
            read(r#"{"tagged": "plain"}"#).unwrap().tagged,
            Some(Tagged::Plain)
        );
        let value: serde_json::Value = serde_json::from_str(whole).unwrap();
        assert_eq!(
            super::from_value::<Outer>(value).unwrap(),
            read(whole).unwrap()
        );
        assert!(super::from_value::<Outer>(serde_json::json!({"inner": [1, 2]})).is_err());
        assert!(super::from_str::<Outer>(r#"{"inner": [1, 2]}"#).is_err());
        assert!(super::from_str::<Outer>(r#"{"inner": {}} x"#).is_err());
        for hostile in [
            r#"[null, null, null, null]"#,
            r#"{"inner": [null, null]}"#,
            r#"{"inner": []}"#,
            r#"{"list": [[1, 2]]}"#,
            r#"{"tagged": {"shape": [5]}}"#,
        ] {
            let error = read(hostile).expect_err(hostile);
            assert!(
                error.contains("invalid type: sequence"),
                "{hostile}: {error}"
            );
        }
    }
}
